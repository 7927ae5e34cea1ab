"""The text models `benchmarks/ragged.py` serves, each telling a request its share of what its
batch computed.

A batch of r requests that ran the model over e token positions (padding included) answers
each request `elements = e / r` and `batches = 1 / r`; summed over every answer, they are the
elements computed and the batches run, read from the model itself.

`CountedRagged` and `CountedPadded` are the bundled model (`batchserve.runner.text_model`),
whose work per token is one embedding row to add. `EncodedRagged` and `EncodedPadded` add a
feed-forward block applied to every token before the mean (256 -> 1024 -> 256, ReLU, as in a
transformer layer), so their cost follows their tokens; the padded one runs it over every
padded position, as a padded encoder does.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from batchserve.runner.text_model import DIM, PaddedText, RaggedText


class CountedRagged(RaggedText):
    def forward(  # type: ignore[override]
        self, tokens: Tensor, offsets: Tensor
    ) -> dict[str, Tensor]:
        return _counted(super().forward(tokens, offsets), tokens.numel())


class CountedPadded(PaddedText):
    def forward(  # type: ignore[override]
        self, tokens: Tensor, lengths: Tensor
    ) -> dict[str, Tensor]:
        return _counted(super().forward(tokens, lengths), tokens.numel())


class EncodedRagged(RaggedText):
    def __init__(self) -> None:
        super().__init__()
        self.encode = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.ReLU(), nn.Linear(4 * DIM, DIM))
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for parameter in self.encode.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)

    def forward(  # type: ignore[override]
        self, tokens: Tensor, offsets: Tensor
    ) -> dict[str, Tensor]:
        features = self.encode(self.bag.weight[tokens])
        starts = torch.cat((offsets.new_zeros(1), offsets[:-1]))
        positions = torch.arange(tokens.numel())
        means = nn.functional.embedding_bag(positions, features, starts, mode="mean")
        return _counted(self.score(means), tokens.numel())


class EncodedPadded(EncodedRagged):
    def forward(  # type: ignore[override]
        self, tokens: Tensor, lengths: Tensor
    ) -> dict[str, Tensor]:
        rows, longest = tokens.shape
        features = self.encode(self.bag.weight[tokens])  # every padded position
        real = (torch.arange(longest) < lengths[:, None]).to(features.dtype)
        means = (features * real[:, :, None]).sum(1) / lengths[:, None].to(features.dtype)
        return _counted(self.score(means), tokens.numel())


def _counted(scores: Tensor, elements: int) -> dict[str, Tensor]:
    share = torch.full((scores.shape[0], 1), 1.0 / scores.shape[0], dtype=torch.float64)
    return {"scores": scores, "elements": share * elements, "batches": share}
