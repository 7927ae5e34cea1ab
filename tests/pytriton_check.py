"""PyTriton's own client against a batchserve server: run in a venv with nvidia-pytriton.

`python tests/pytriton_check.py URL` calls `pytriton.client.ModelClient` the way a PyTriton
user does: it reads each model's configuration from the server, then infers. It prints one
JSON object, each call's outputs as lists, for `tests/test_pytriton.py` to compare with
batchserve's own answers. Only the standard library, numpy and pytriton are imported here:
nvidia-pytriton pins numpy below 2, so it cannot share batchserve's venv.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
from pytriton.client import ModelClient

FLOWERS = np.array([[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]], dtype=np.float32)


def listed(outputs: dict[str, np.ndarray]) -> dict[str, Any]:
    """Each output's shape and its elements in order, strings decoded."""
    return {name: {"shape": list(array.shape),
                   "data": [item.decode() if isinstance(item, bytes) else item
                            for item in array.ravel().tolist()]}
            for name, array in outputs.items()}


def main(url: str) -> dict[str, Any]:
    found: dict[str, Any] = {}
    with ModelClient(url, "iris_clf", init_timeout_s=60) as client:
        found["iris_clf_batching"] = client.model_config.batching
        found["iris_clf_max_batch_size"] = client.model_config.max_batch_size
        found["iris_clf_batch"] = listed(client.infer_batch(input=FLOWERS))
        found["iris_clf_sample"] = listed(client.infer_sample(input=FLOWERS[1]))
    with ModelClient(url, "mlp", init_timeout_s=60) as client:
        rows = np.linspace(-1, 1, 3 * 256, dtype=np.float32).reshape(3, 256)
        found["mlp_batch"] = listed(client.infer_batch(x=rows))
    with ModelClient(url, "text_features", init_timeout_s=60) as client:
        found["text_features_sample"] = listed(client.infer_sample(
            text=np.array([b"a,b,,c", "naïve,café".encode()], dtype=object),
            separator=np.array([b","], dtype=object)))
    with ModelClient(url, "text", init_timeout_s=60) as client:
        found["text_sample"] = listed(client.infer_sample(tokens=np.arange(1, 6, dtype=np.int64)))
    return found


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
