"""The example image model: a ResNet-18-shaped network, built with torch alone, nothing downloaded.

The shape is torchvision's `resnet18` (a 7x7 stem, four stages of two basic blocks, 64 to 512
channels, average pooling and 1000 class scores), written out here so that no other package
is needed; its weights are drawn from a fixed seed, so every process serves the same model.
Its cost is what matters, not its answers: about 1.8 GFLOP an image, some tens of
milliseconds on one CPU core, growing less than linearly with the batch until the cores are
full. Batch normalization is folded away (the identity with its fresh statistics), as a
served model would fold it into the convolutions.

Images come as `[N, 3, 224, 224]`, FP32 in [0, 1] or UINT8 in [0, 255]: a runner's input has
one datatype, so each is its own runner in `examples/models.yml` (`resnet`, `resnet_uint8`),
both served by `ResNet`, which scales UINT8 pixels by 1/255 itself. A UINT8 image is a
quarter of the bytes on the wire.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

SEED = 0
CLASSES = 1000
SIZE = 224


class Block(nn.Module):
    """A basic residual block: two 3x3 convolutions, with a 1x1 projection when it strides."""

    def __init__(self, inside: int, outside: int, stride: int) -> None:
        super().__init__()
        self.first = nn.Conv2d(inside, outside, 3, stride, 1)
        self.second = nn.Conv2d(outside, outside, 3, 1, 1)
        self.project = (nn.Conv2d(inside, outside, 1, stride) if stride != 1 or inside != outside
                        else nn.Identity())

    def forward(self, x: Tensor) -> Tensor:
        out = self.second(torch.relu(self.first(x)))
        return torch.relu(out + self.project(x))


class ResNet(nn.Module):
    """Class scores `[N, 1000]` for images `[N, 3, 224, 224]` (FP32 in [0, 1], or UINT8)."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            self.stem = nn.Conv2d(3, 64, 7, 2, 3)
            widths = (64, 128, 256, 512)
            stages: list[nn.Module] = []
            inside = 64
            for stage, width in enumerate(widths):
                stride = 1 if stage == 0 else 2
                stages += (Block(inside, width, stride), Block(width, width, 1))
                inside = width
            self.stages = nn.Sequential(*stages)
            self.head = nn.Linear(512, CLASSES)
        # Channels last is oneDNN's own layout: convolutions on it take some 30% less time
        # on a CPU than on [N, C, H, W], which is worth the one pass that lays images out so.
        self.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        self.eval()

    def forward(self, images: Tensor) -> Tensor:
        if images.dtype == torch.uint8:  # the cast and the layout in one pass
            images = images.to(torch.float32, memory_format=torch.channels_last).mul_(1 / 255)
        else:
            images = images.contiguous(memory_format=torch.channels_last)
        x = torch.relu(self.stem(images))
        x = nn.functional.max_pool2d(x, 3, 2, 1)
        x = self.stages(x)
        scores: Tensor = self.head(x.mean(dim=(2, 3)))
        return scores
