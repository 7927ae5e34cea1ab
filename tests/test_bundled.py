"""The bundled models: the iris classifier is trained once, cached, and predicts like sklearn."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sklearn.datasets import load_iris
from sklearn.linear_model import LogisticRegression

from batchserve.runner import bundled


def test_iris_is_trained_at_first_start_then_loaded_from_its_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    features, labels = load_iris(return_X_y=True)
    rows = features.astype(np.float32)
    first = bundled.iris_classifier()(rows)
    cached = tmp_path / "batchserve" / "iris_clf.npz"
    assert cached.is_file()
    stamp = cached.stat().st_mtime_ns
    again = bundled.iris_classifier()(rows)
    assert cached.stat().st_mtime_ns == stamp  # loaded, not trained and written again
    np.testing.assert_array_equal(first, again)
    reference = LogisticRegression(max_iter=1000).fit(features, labels).predict_proba(rows)
    np.testing.assert_allclose(first, reference, rtol=1e-5, atol=1e-7)
    assert first.dtype == np.float32
    assert (first.argmax(axis=1) == labels).mean() > 0.95


def test_a_broken_cache_is_retrained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    (tmp_path / "batchserve").mkdir()
    (tmp_path / "batchserve" / "iris_clf.npz").write_bytes(b"not an npz")
    scores = bundled.iris_classifier()(np.array([[5.1, 3.5, 1.4, 0.2]], np.float32))
    assert scores.argmax() == 0
    with np.load(tmp_path / "batchserve" / "iris_clf.npz") as saved:
        assert saved["weights"].shape == (3, 4)
