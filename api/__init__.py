"""The API tier: HTTP workers that speak the Open Inference Protocol v2 and forward to runners."""
