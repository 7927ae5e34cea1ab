"""batchserve's `classify` pipeline beside the same steps chained by the client and a mosec
pipeline of the same two steps: `python -m benchmarks.pipeline_peers`."""
