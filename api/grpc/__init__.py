"""The gRPC door: the Open Inference Protocol v2 over gRPC (`inference.GRPCInferenceService`
and `grpc.health.v1.Health`), served by every API worker beside HTTP, into the same exchange
(`batchserve.api.service`) as HTTP once a request's tensors are decoded."""
