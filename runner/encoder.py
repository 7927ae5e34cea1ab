"""The example transformer: a small BERT-shaped encoder over token ids of any length.

Four post-norm encoder layers of hidden size 256 with 4 heads and a 1024-wide feed-forward,
over learned token and position embeddings, for sequences of up to `LONGEST` tokens; the
weights are drawn from a fixed seed, so every process serves the same model. An id is taken
modulo `VOCAB` (the hashing trick), so any id is valid and none can fail its batch. Each
request is one sequence; it is answered with the mean of its last layer over its tokens
(`embedding`, 256 values), as a sentence embedding is.

A batch comes ragged, as in the bundled `text` model: every request's ids concatenated
(`tokens`) and where each ends (`offsets`). The model lays them out as rows padded to the
longest, with a padding mask, and torch's encoder runs them as nested tensors, so no padded
token is computed: the batch costs about its tokens, which is what the runner counts
(`max_batch_elements`), plus each sequence's attention, which grows with its length squared.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

VOCAB = 8192
LONGEST = 256
HIDDEN = 256
HEADS = 4
LAYERS = 4
SEED = 0


class Encoder(nn.Module):
    """A sentence embedding `[requests, 256]` for a ragged batch: flat `tokens`, end `offsets`."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            self.tokens = nn.Embedding(VOCAB, HIDDEN)
            self.positions = nn.Embedding(LONGEST, HIDDEN)
            self.norm = nn.LayerNorm(HIDDEN)
            layer = nn.TransformerEncoderLayer(HIDDEN, HEADS, 4 * HIDDEN, dropout=0.0,
                                               activation="gelu", batch_first=True)
            self.layers = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=True)
        self.eval()
        # torch warns once a process that nested tensors are a prototype: once here, not in
        # the first batch served (or in a test that turns warnings into errors).
        with warnings.catch_warnings(), torch.inference_mode():
            warnings.simplefilter("ignore", UserWarning)
            self(torch.zeros(3, dtype=torch.int64), torch.tensor([1, 3]))

    def forward(self, tokens: Tensor, offsets: Tensor) -> Tensor:
        lengths = torch.diff(offsets, prepend=offsets.new_zeros(1))
        rows = [row[:LONGEST] for row in torch.split(tokens.remainder(VOCAB), lengths.tolist())]
        lengths = lengths.clamp(max=LONGEST)
        ids = nn.utils.rnn.pad_sequence(rows, batch_first=True)
        padding = torch.arange(ids.shape[1]) >= lengths[:, None]
        x = self.norm(self.tokens(ids) + self.positions.weight[: ids.shape[1]])
        x = self.layers(x, src_key_padding_mask=padding)
        real = (~padding).unsqueeze(-1).to(x.dtype)
        means: Tensor = (x * real).sum(1) / lengths[:, None].to(x.dtype)
        return means
