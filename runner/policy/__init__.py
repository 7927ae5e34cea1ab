"""The pure batching policies (the contract in `base`, `adaptive` with its state in `state` and
its constants in `tuning`, the baselines, building any by name in `policies`), the batch
latency model they decide with, and a pipeline's one deadline shared among its steps (`chain`):
no socket, task or thread, driven alike by the live runner and API worker and the simulator."""
