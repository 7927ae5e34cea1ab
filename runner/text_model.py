"""The bundled text classifier: token ids of any length to class scores, nothing downloaded.

Each request is one sequence of INT64 token ids; an id is taken modulo `VOCAB` (the hashing
trick), so any id is valid and none can fail the batch it rides in. The model averages their
embeddings (`nn.EmbeddingBag`) and scores the average with a linear layer; the weights are
drawn from a fixed seed, so every process serves the same model, and a request's scores are
the same bits whatever batch it ran in. Two forms of one model, with equal answers:

- `RaggedText` takes the batch's tokens concatenated (`tokens`, flat) and the batch input
  `offsets`, the accumulated element count: where each request ends, `[3, 7, 12]` for
  lengths 3, 4 and 5. `nn.EmbeddingBag` wants where each starts, `[0, 3, 7]`: the model
  shifts them. No padded element is ever computed.
- `PaddedText` takes the tokens padded to the longest request (`tokens`, rows) and the batch
  input `lengths`, the element count of each; it computes every padded position (with a
  weight of 0), as a padded model does.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

VOCAB = 20_000
DIM = 256
CLASSES = 4
SEED = 0


class RaggedText(nn.Module):
    """Class scores for each request of a ragged batch: flat `tokens` and end `offsets`."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCAB, DIM, mode="mean")
        self.head = nn.Linear(DIM, CLASSES)
        generator = torch.Generator().manual_seed(SEED)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
        self.eval()

    def forward(self, tokens: Tensor, offsets: Tensor) -> Tensor:
        tokens = tokens.remainder(VOCAB)
        starts = torch.cat((offsets.new_zeros(1), offsets[:-1]))
        return self.score(self.bag(tokens, starts))

    def score(self, means: Tensor) -> Tensor:
        """The linear layer row by row (a product and a sum, not a matrix product, whose
        rounding may change with the batch's size), so each request's scores are the same
        bits in any batch as alone."""
        return (means.unsqueeze(1) * self.head.weight).sum(-1) + self.head.bias


class PaddedText(RaggedText):
    """The same model for a padded batch: `tokens` as rows and each row's `lengths`."""

    def forward(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        tokens = tokens.remainder(VOCAB)
        rows, longest = tokens.shape
        weight = self.bag.weight
        real = (torch.arange(longest) < lengths[:, None]).to(weight.dtype)
        starts = torch.arange(rows) * longest
        sums = nn.functional.embedding_bag(
            tokens.reshape(-1), weight, starts, mode="sum", per_sample_weights=real.reshape(-1)
        )
        return self.score(sums / lengths[:, None].to(weight.dtype))

