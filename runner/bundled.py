"""The models the bundled `configuration.yml` serves, built with nothing downloaded."""

from __future__ import annotations

import contextlib
import os
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .core.types import PerRequest


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
        probabilities: np.ndarray = (odds / odds.sum(axis=1, keepdims=True)).astype(np.float32)
        return probabilities

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



def text_features(text: np.ndarray, separator: PerRequest) -> dict[str, np.ndarray]:
    """Features of UTF-8 strings (BYTES rows), split into words at each request's separator.

    `separator` is a non-batchable BYTES input: one array of one string per request, so
    requests with different separators still batch together; an empty one (the default)
    splits at any whitespace. Returns, per row, `features` (characters, UTF-8 bytes, words,
    and a CRC-32 hash bucket in [0, 1)) and `normalized`, the non-empty words joined by
    single spaces, as BYTES. Bytes that are not UTF-8 read as U+FFFD.
    """
    separators = separator.per_row()
    features = np.empty((len(text), 4), np.float32)
    normalized = np.empty(len(text), object)
    for row, (raw, chosen) in enumerate(zip(text, separators, strict=True)):
        decoded = raw.decode(errors="replace")
        cut = bytes(chosen.reshape(-1)[0]).decode(errors="replace") or None
        words = [word for word in decoded.split(cut) if word]
        joined = " ".join(words).encode()
        bucket = (zlib.crc32(joined) % 1024) / 1024
        features[row] = (len(decoded), len(raw), len(words), bucket)
        normalized[row] = joined
    return {"features": features, "normalized": normalized}


CASES = ("upper", "lower", "title")


def recase(text: np.ndarray, *, case: str) -> np.ndarray:
    """UTF-8 strings (BYTES rows) in one letter case: `upper`, `lower` or `title`.

    `case` is a request parameter, not an input, and one call takes one value of it, as a
    translation model takes one source and target language: the runner's `group_by: [case]`
    batches only requests that ask for the same case. An unknown case fails its batch.
    """
    if case not in CASES:
        raise ValueError(f"case {case!r} is not one of {', '.join(CASES)}")
    out = np.empty(len(text), object)
    for row, raw in enumerate(text):
        out[row] = getattr(raw.decode(errors="replace"), case)().encode()
    return out


BEGIN_ID = 1
"""The id every token sequence starts with, so that even an empty string is one token: the
text classifier after it takes sequences of at least one."""
WORD_IDS = 19_999
"""Word ids are 2 .. WORD_IDS + 1, within the classifier's vocabulary of 20,000."""


def tokenize(text: np.ndarray) -> dict[str, list[np.ndarray]]:
    """Token ids of UTF-8 strings (BYTES rows): a begin id, then one id a word, lower-cased
    and split at whitespace, hashed with CRC-32 (the hashing trick: no vocabulary to
    download, and any word has an id). The output `tokens` is ragged, one sequence a row of
    any length, as the bundled `text` classifier reads its input."""
    return {"tokens": [_token_ids(raw) for raw in text]}


def _token_ids(raw: bytes) -> np.ndarray:
    words = raw.decode(errors="replace").lower().split()
    ids = [BEGIN_ID] + [2 + zlib.crc32(word.encode()) % WORD_IDS for word in words]
    return np.array(ids, dtype=np.int64)
