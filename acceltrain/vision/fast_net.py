"""A small, fast CIFAR network: the architecture of airbench94 (Keller Jordan, arXiv 2404.00498), which
reaches 94% CIFAR-10 accuracy in about 10 epochs with whitening, label smoothing, alternating flips and TTA.
About 2M parameters; 0.24 GFLOP a 32x32 image forward, 0.71 forward and backward."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class ConvGroup(nn.Sequential):
    """conv 3x3 -> max-pool 2 -> BatchNorm -> GELU -> conv 3x3 -> BatchNorm -> GELU. Pooling before the
    first norm halves that norm's work; convs have no bias (BatchNorm follows)."""

    def __init__(self, in_channels: int, out_channels: int, batchnorm_momentum: float):
        super().__init__(
            _identity_init(nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False)),
            nn.MaxPool2d(2),
            _batchnorm(out_channels, batchnorm_momentum),
            nn.GELU(),
            _identity_init(nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)),
            _batchnorm(out_channels, batchnorm_momentum),
            nn.GELU(),
        )


class FastCifarNet(nn.Module):
    """A first conv of ``whitening_kernel`` x ``whitening_kernel`` with ``2 x 3 x k^2`` outputs and a bias
    (meant for :func:`acceltrain.vision.whiten_first_conv`: the ``--whiten-first-conv`` flag), GELU, three
    :class:`ConvGroup` of ``widths`` channels each halving the resolution, a global max-pool and a linear head
    without bias whose logits are multiplied by ``output_scale`` (small logits at the start train faster).

    BatchNorm scales are fixed at 1 (only the shifts learn), their eps is 1e-12 and their running statistics
    move fast (``batchnorm_momentum`` in PyTorch's convention: weight of the new batch), as in airbench. Every
    constructor argument is a JSON value, so the config can be saved next to the weights.
    """

    def __init__(
        self,
        num_classes: int = 10,
        widths: Sequence[int] = (64, 256, 256),
        whitening_kernel: int = 2,
        batchnorm_momentum: float = 0.4,
        output_scale: float = 1 / 9,
    ):
        super().__init__()
        whitening_width = 2 * 3 * whitening_kernel**2
        self.whiten = nn.Conv2d(3, whitening_width, whitening_kernel, bias=True)
        nn.init.zeros_(self.whiten.bias)
        self.activation = nn.GELU()
        channels, groups = whitening_width, []
        for width in widths:
            groups.append(ConvGroup(channels, width, batchnorm_momentum))
            channels = width
        self.groups = nn.Sequential(*groups)
        self.pool = nn.AdaptiveMaxPool2d(1)
        self.head = nn.Linear(channels, num_classes, bias=False)
        self.output_scale = output_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.pool(self.groups(self.activation(self.whiten(x)))).flatten(1)
        return self.head(features) * self.output_scale


def _batchnorm(channels: int, momentum: float) -> nn.BatchNorm2d:
    norm = nn.BatchNorm2d(channels, eps=1e-12, momentum=momentum)
    norm.weight.requires_grad_(False)
    return norm


def _identity_init(conv: nn.Conv2d) -> nn.Conv2d:
    """The first ``in_channels`` filters pass their input channel through (Dirac), the rest stay random:
    an implicit residual connection at the start of training (airbench: fewer epochs to the same accuracy)."""
    with torch.no_grad():
        nn.init.dirac_(conv.weight[: conv.in_channels])
    return conv
