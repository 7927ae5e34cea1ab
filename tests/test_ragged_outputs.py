"""Ragged outputs: one sequence a row from the model, one flat sequence a request in the
answer, whatever batch the request ran in or however it was cut."""

from __future__ import annotations

import numpy as np
import pytest

from batchserve.runner import batching, bundled
from batchserve.runner.core.config import ConfigError, parse
from batchserve.runner.models import Model

TOKENIZE = {
    "model": "batchserve.runner.bundled:tokenize",
    "inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]}],
    "outputs": [{"name": "tokens", "datatype": "INT64", "shape": [-1], "ragged": True}],
}


def test_a_request_gets_its_rows_sequences_as_one() -> None:
    sequences = np.empty(3, dtype=object)
    sequences[:] = [np.array([1, 2]), np.array([3]), np.array([4, 5, 6])]
    first, second = batching.split({"t": sequences}, [1, 2], 0, ragged={"t"})
    assert first["t"].tolist() == [1, 2]
    assert second["t"].tolist() == [3, 4, 5, 6]


def test_the_tokenizer_answers_each_string_alike_in_any_batch() -> None:
    runner = parse({"runners": {"tokenize": TOKENIZE}}).runners["tokenize"]
    model = Model(runner, bundled.tokenize, torch=False)
    text = np.array([b"The quick fox", b"", b"fox"], dtype=object)
    pieces = batching.split(model({"text": text}, {}), [1, 1, 1], 0, ragged={"tokens"})
    assert [piece["tokens"].tolist()[0] for piece in pieces] == [1, 1, 1]  # the begin id
    assert len(pieces[0]["tokens"]) == 4 and pieces[1]["tokens"].tolist() == [1]
    assert pieces[0]["tokens"][-1] == pieces[2]["tokens"][-1]  # 'fox' is 'fox' anywhere
    alone = model({"text": text[:1]}, {})["tokens"][0]
    assert alone.tolist() == pieces[0]["tokens"].tolist()


@pytest.mark.parametrize(("change", "message"), [
    ({"datatype": "BYTES"}, "runners.tokenize.outputs[0].datatype has value 'BYTES'; it must "
                            "be a datatype other than BYTES for a ragged output"),
    ({"shape": [-1, 2]}, "runners.tokenize.outputs[0].shape has value [-1, 2]; it must be "
                         "[-1] for a ragged output"),
])
def test_a_ragged_output_is_one_flat_sequence_of_numbers(change: dict[str, object],
                                                         message: str) -> None:
    output = {**TOKENIZE["outputs"][0], **change}  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse({"runners": {"tokenize": {**TOKENIZE, "outputs": [output]}}})
