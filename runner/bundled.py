"""The models the bundled `configuration.yml` serves, built with nothing downloaded."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def iris_classifier() -> Callable[[np.ndarray], np.ndarray]:
    """A logistic regression on scikit-learn's bundled iris data, trained deterministically.

    Training takes a few milliseconds, so it happens at each start instead of being cached.
    Returns class probabilities (setosa, versicolor, virginica) for rows of 4 features.
    """
    from sklearn.datasets import load_iris
    from sklearn.linear_model import LogisticRegression

    features, labels = load_iris(return_X_y=True)
    classifier = LogisticRegression(max_iter=1000).fit(features, labels)

    def predict(rows: np.ndarray) -> np.ndarray:
        return classifier.predict_proba(rows).astype(np.float32)

    return predict


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
