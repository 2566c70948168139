"""Crop and flip augmentation keyed on ``(seed, epoch, index)``: every loader, process count and resume draws the
same augmented sample, with no random state to checkpoint."""

from __future__ import annotations

import torch

from acceltrain.config.options import ConfigError
from acceltrain.vision.names import FLIPS, PADDING_MODES


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) of int64 tensors holding values in [0, 2**32), computed without
    64-bit overflow, so it gives the same bits on every device and in every process."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def hash32_int(x: int) -> int:
    """:func:`hash32` for one Python int (exact: Python ints do not overflow); 50x faster per sample."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & 0xFFFFFFFF


class CropFlip:
    """Random crop (translation by up to ``padding`` pixels, zero or reflect padding) plus horizontal flip
    on uint8 images.

    ``flip``: ``random`` draws each sample's flip anew every epoch; ``alternating`` (airbench,
    arXiv 2404.00498) keeps epoch 0's random flip and inverts it on odd epochs, so every image is seen both
    ways in any two consecutive epochs (fewer epochs for the same accuracy); ``none``. The crop draws do
    not depend on the flip mode.

    The draws are a pure function of ``(seed, epoch, sample index)`` (``draws``), in vectorised integer
    arithmetic, and ``apply`` crops and flips a whole batch with one gather on any device. So the
    per-sample DataLoader path and the on-device loader augment every sample identically.
    """

    def __init__(self, padding: int = 4, flip: str = "random", padding_mode: str = "zeros"):
        if not (isinstance(padding, int) and padding >= 0):
            raise ConfigError(f"crop padding {padding!r} is invalid: must be an integer >= 0")
        if flip not in FLIPS:
            raise ConfigError(f"flip {flip!r} is invalid: choose one of {', '.join(FLIPS)}")
        if padding_mode not in PADDING_MODES:
            raise ConfigError(
                f"crop padding mode {padding_mode!r} is invalid: choose one of {', '.join(PADDING_MODES)}"
            )
        self.padding = padding
        self.flip = flip
        self.padding_mode = padding_mode

    @staticmethod
    def _epoch_key(seed: int, epoch: int) -> int:
        return hash32_int(hash32_int(seed & 0xFFFFFFFF) ^ (epoch & 0xFFFFFFFF))

    def draws(self, seed: int, epoch: int, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(top, left, flip) for each sample index: crop offsets in [0, 2*padding] and a 0/1 flip."""
        indices = indices.long() & 0xFFFFFFFF
        bits = hash32(self._epoch_key(seed, epoch) ^ indices)
        first_bits = hash32(self._epoch_key(seed, 0) ^ indices) if self.flip == "alternating" else bits
        return self._split(bits, first_bits, epoch)

    def _split(self, bits, first_bits, epoch: int):
        """Offsets from this epoch's bits; the flip from them (random), from epoch 0's (alternating), or none."""
        span = 2 * self.padding + 1
        top, left = bits % span, (bits >> 8) % span
        if self.flip == "random":
            flip = (bits >> 16) & 1
        elif self.flip == "alternating":
            flip = ((first_bits >> 16) & 1) ^ (epoch & 1)
        else:
            flip = bits * 0
        return top, left, flip

    def check_image_size(self, height: int, width: int) -> None:
        """ConfigError unless the padding fits these images: reflect padding needs ``padding < min(height, width)``."""
        if self.padding_mode == "reflect" and self.padding >= min(height, width):
            raise ConfigError(
                f"crop padding {self.padding} is invalid for reflect padding of {height}x{width} images: must be < "
                f"{min(height, width)}"
            )

    def apply(self, images: torch.Tensor, top: torch.Tensor, left: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
        """Crop and flip a uint8 batch (B, C, H, W) with one flat gather, no padded copy: source pixels
        outside the image are the zero padding, or their mirror image inside it. Returns a contiguous NCHW batch."""
        batch, channels, height, width = images.shape
        self.check_image_size(height, width)
        pad, device = self.padding, images.device
        rows = top.view(-1, 1) - pad + torch.arange(height, device=device)
        columns = torch.arange(width, device=device)
        columns = torch.where(flip.view(-1, 1).bool(), width - 1 - columns, columns) + left.view(-1, 1) - pad
        if self.padding_mode == "reflect":  # what F.pad(mode="reflect") puts there: the edge pixel is not repeated
            rows, columns = _reflect(rows, height), _reflect(columns, width)
        inside = ((rows >= 0) & (rows < height)).view(batch, 1, height, 1) & ((columns >= 0) & (columns < width)).view(
            batch, 1, 1, width
        )
        source = rows.clamp(0, height - 1).view(batch, height, 1) * width + columns.clamp(0, width - 1).view(
            batch, 1, width
        )
        cropped = images.flatten(2).gather(2, source.view(batch, 1, -1).expand(batch, channels, -1))
        return cropped.view(batch, channels, height, width).masked_fill_(~inside, 0)

    def __call__(self, image: torch.Tensor, seed: int, epoch: int, index: int) -> torch.Tensor:
        """One CHW image: the same result as ``apply`` on a batch of one, by plain slicing (much faster)."""
        bits = hash32_int(self._epoch_key(seed, epoch) ^ (index & 0xFFFFFFFF))
        first_bits = hash32_int(self._epoch_key(seed, 0) ^ (index & 0xFFFFFFFF)) if self.flip == "alternating" else bits
        top, left, flip = self._split(bits, first_bits, epoch)
        _, height, width = image.shape
        self.check_image_size(height, width)
        pad = self.padding
        mode = "reflect" if self.padding_mode == "reflect" else "constant"
        padded = torch.nn.functional.pad(image, (pad, pad, pad, pad), mode=mode) if pad else image
        cropped = padded[:, top : top + height, left : left + width]
        return cropped.flip(-1) if flip else cropped


def _reflect(positions: torch.Tensor, size: int) -> torch.Tensor:
    """Positions up to ``size - 1`` outside [0, size) mirrored inside it about the edge pixels."""
    positions = positions.abs()
    return torch.where(positions > size - 1, 2 * (size - 1) - positions, positions)
