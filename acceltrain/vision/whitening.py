"""Whitening initialisation of a network's first convolution (airbench, arXiv 2404.00498): its filters
become the principal directions of the training images' patches, scaled to unit variance, so the first
layer starts out decorrelating its input instead of learning to, and may stay frozen."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from acceltrain.config.options import ConfigError
from acceltrain.data.loaders import mix_seed


def whitening_images(dataset, count: int, *, seed: int) -> torch.Tensor:
    """A seeded random subset of ``count`` training images (all of them if fewer), normalised and without
    augmentation, through the dataset's own loading (``dataset[i]``). Random rather than the first
    ``count``: an ImageFolder listing is sorted by class."""
    generator = torch.Generator().manual_seed(mix_seed(seed, 0x3817E))
    indices = torch.randperm(len(dataset), generator=generator)[:count]
    return torch.stack([dataset[i][0] for i in indices.tolist()])


def patch_moments(
    images: torch.Tensor, kernel_size: tuple[int, int], dilation: tuple[int, int] = (1, 1)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, covariance) in float64 of every ``kernel_size`` patch of ``images`` (N, C, H, W), flattened
    in a conv weight's (C, kh, kw) order; accumulated over chunks so memory stays bounded."""
    channels = images.shape[1]
    dimension = channels * kernel_size[0] * kernel_size[1]
    positions = (images.shape[2] - dilation[0] * (kernel_size[0] - 1)) * (
        images.shape[3] - dilation[1] * (kernel_size[1] - 1)
    )
    chunk = max(1, 2**23 // max(1, positions * dimension))
    total = torch.zeros(dimension, dtype=torch.float64)
    products = torch.zeros(dimension, dimension, dtype=torch.float64)
    count = 0
    for part in images.split(chunk):
        patches = F.unfold(part.double(), kernel_size, dilation=dilation).transpose(1, 2).reshape(-1, dimension)
        total += patches.sum(0)
        products += patches.T @ patches
        count += len(patches)
    mean = total / count
    return mean, products / count - torch.outer(mean, mean)


@torch.no_grad()
def whiten_conv_(conv: nn.Conv2d, images: torch.Tensor, *, eps: float = 5e-4, freeze: bool = True) -> nn.Conv2d:
    """Set ``conv``'s filters to the leading eigenvectors ``v`` of the patch covariance of ``images`` divided
    by ``sqrt(eigenvalue + eps)``, then their negations (a ReLU/GELU after it passes both signs): with
    ``2k`` output channels, the top ``k`` directions. Its bias, if any, centres the outputs. So on these
    images each output pair has (about) unit variance and the first ``k`` outputs are uncorrelated.
    ``freeze``: the weights stop training (the bias does not). Returns ``conv``."""
    channels, kh, kw = conv.weight.shape[1:]
    dimension = channels * kh * kw
    if conv.groups != 1 or conv.out_channels % 2 or conv.out_channels > 2 * dimension:
        raise ConfigError(
            "whitening needs a conv with groups=1 and an even number of output channels, at most 2 x "
            f"{channels}x{kh}x{kw} = {2 * dimension}; this one is {conv.in_channels}->{conv.out_channels} channels, "
            f"{kh}x{kw}, groups={conv.groups}"
        )
    mean, covariance = patch_moments(images.to("cpu"), (kh, kw), conv.dilation)
    eigenvalues, eigenvectors = torch.linalg.eigh(covariance)  # ascending
    count = conv.out_channels // 2
    top = eigenvectors[:, -count:].flip(1).T / (eigenvalues[-count:].flip(0).clamp(min=0) + eps).sqrt().unsqueeze(1)
    weight = torch.cat([top, -top])
    conv.weight.copy_(weight.view_as(conv.weight))
    if conv.bias is not None:
        conv.bias.copy_(-(weight @ mean))
    conv.weight.requires_grad_(not freeze)
    return conv


def whiten_first_conv(model: nn.Module, images: torch.Tensor, *, eps: float = 5e-4, freeze: bool = True) -> nn.Conv2d:
    """:func:`whiten_conv_` on the first ``nn.Conv2d`` of ``model`` (in ``model.modules()`` order), before
    the optimizer is built (so a frozen weight is left out of it)."""
    conv = next((module for module in model.modules() if isinstance(module, nn.Conv2d)), None)
    if conv is None:
        raise ConfigError(f"whitening needs a model with a Conv2d; {type(model).__name__} has none")
    try:
        return whiten_conv_(conv, images, eps=eps, freeze=freeze)
    except ConfigError as err:
        raise ConfigError(f"{type(model).__name__}'s first conv: {err}") from None


class FreezeAfterEpochs:
    """A hook that holds ``param`` at its value from the start of epoch ``epochs`` on: airbench94 trains its
    whitening conv's bias for the first 3 epochs only. The optimizer still steps it (its momentum and weight
    decay would move it on), so after every step, and after the last hook's end-of-training update (a
    lookahead's), it is put back: exact for any optimizer, the same on every process, and a resumed run
    captures the frozen value from the checkpointed weights. Pass it after the hooks that change weights."""

    def __init__(self, param: torch.Tensor, epochs: int):
        self.param, self.epochs, self.frozen = param, epochs, None

    def on_epoch_start(self, run) -> None:
        if run.epoch >= self.epochs and self.frozen is None:
            self.frozen = self.param.detach().clone()

    def on_step_end(self, run) -> None:
        if self.frozen is not None:
            with torch.no_grad():
                self.param.copy_(self.frozen)

    on_train_end = on_step_end
