"""The pure batching policies (the contract in `base`, `adaptive` with its state in `state` and
its constants in `tuning`, the baselines, building any by name in `policies`) and the batch
latency model they decide with: no socket, task or thread, driven alike by the live dispatcher
and the simulator."""
