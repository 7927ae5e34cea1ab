"""The discrete-event simulator: scenario files, simulated and recorded batch times, and the
virtual clock that plays them against the real policies (`batchserve simulate`)."""
