"""The models the bundled `configuration.yml` serves, built with nothing downloaded."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np


def iris_classifier() -> Callable[[np.ndarray], np.ndarray]:
    """A logistic regression on scikit-learn's bundled iris data, trained deterministically.

    It is trained at first start and its weights cached, so later starts skip the fit and
    serve the very same weights, whatever scikit-learn version is installed by then;
    predicting is a softmax over 4 x 3 weights.
    Returns class probabilities (setosa, versicolor, virginica) for rows of 4 features.
    """
    weights, bias = _iris_weights()

    def predict(rows: np.ndarray) -> np.ndarray:
        logits = rows.astype(np.float64) @ weights.T + bias
        logits -= logits.max(axis=1, keepdims=True)
        odds = np.exp(logits)
        return (odds / odds.sum(axis=1, keepdims=True)).astype(np.float32)

    return predict


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "batchserve"


def _iris_weights() -> tuple[np.ndarray, np.ndarray]:
    path = cache_dir() / "iris_clf.npz"
    try:
        with np.load(path) as saved:  # allow_pickle stays False: plain arrays only
            return saved["weights"], saved["bias"]
    except (OSError, KeyError, ValueError):
        pass
    from sklearn.datasets import load_iris
    from sklearn.linear_model import LogisticRegression

    features, labels = load_iris(return_X_y=True)
    classifier = LogisticRegression(max_iter=1000).fit(features, labels)
    weights, bias = classifier.coef_, classifier.intercept_
    with contextlib.suppress(OSError):  # a read-only home only costs the next start a fit
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"iris_clf.{os.getpid()}.npz")
        np.savez(partial, weights=weights, bias=bias)
        os.replace(partial, path)
    return weights, bias


def mlp() -> object:
    """A torch MLP 256 -> 1024 -> 1024 -> 16 with fixed-seed weights, for load tests."""
    import torch

    generator = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 16),
    )
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model.eval()
