"""`cnn`: two conv + BatchNorm blocks, global average pooling and a linear head,
for 8x8 (digits) or 28x28 images, in PyTorch and in Flax NNX.

Both twins take NCHW images (the NNX one transposes to NHWC itself), so they
consume the same numpy batches. BatchNorm normalises with batch statistics in
training in both; their running variance differs (PyTorch stores the unbiased
estimate, Flax the biased one), which never enters a training step.
"""

from __future__ import annotations

import torch
from torch import nn


class TorchCNN(nn.Module):
    def __init__(self, in_channels: int = 1, channels: tuple[int, int] = (8, 16), num_classes: int = 10):
        super().__init__()
        c1, c2 = channels
        # No conv bias: BatchNorm subtracts the mean right after, so its gradient would be
        # rounding noise -- which Adam would then amplify into lr-sized steps.
        self.conv1 = nn.Conv2d(in_channels, c1, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c1)
        self.conv2 = nn.Conv2d(c1, c2, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c2)
        self.head = nn.Linear(c2, num_classes)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


def nnx_cnn(in_channels: int = 1, channels: tuple[int, int] = (8, 16), num_classes: int = 10):
    import jax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    class NnxCNN(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            c1, c2 = channels
            self.conv1 = nnx.Conv(in_channels, c1, (3, 3), padding=1, use_bias=False, rngs=rngs)
            # Flax's momentum is PyTorch's (1 - momentum); epsilon matches PyTorch's 1e-5.
            self.bn1 = nnx.BatchNorm(c1, momentum=0.9, epsilon=1e-5, rngs=rngs)
            self.conv2 = nnx.Conv(c1, c2, (3, 3), padding=1, use_bias=False, rngs=rngs)
            self.bn2 = nnx.BatchNorm(c2, momentum=0.9, epsilon=1e-5, rngs=rngs)
            self.head = nnx.Linear(c2, num_classes, rngs=rngs)

        def __call__(self, x):
            x = x.transpose(0, 2, 3, 1)  # NCHW, as the PyTorch twin takes it, to NHWC
            x = jax.nn.relu(self.bn1(self.conv1(x)))
            x = jax.nn.relu(self.bn2(self.conv2(x)))
            return self.head(x.mean(axis=(1, 2)))

    return NnxCNN(nnx.Rngs(0))
