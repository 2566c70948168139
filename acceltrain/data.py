"""Datasets, augmentation and DataLoaders, built so that a sample's augmentation never depends on the
process count, the batch size, the worker that loads it, or what that worker loaded before.

The training sampler yields ``(epoch, index)`` keys in one global, seeded order that every process
computes identically; Accelerate then shards the batches across processes. A dataset that defines
``sample(index, epoch)`` derives its augmentation randomness from ``(seed, epoch, index)`` alone.
So 2 processes at batch b see the same samples, augmented the same way, as 1 process at batch 2b,
and a resumed run sees the same remaining batches as the uninterrupted one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from .config import ConfigError
from .distributed import on_main_process_first

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp")


def mix_seed(*parts: int) -> int:
    """A deterministic 63-bit seed from integers (splitmix64 steps), stable across processes and runs."""
    state = 0x9E3779B97F4A7C15
    for part in parts:
        state = (state ^ (int(part) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        state = (state ^ (state >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        state ^= state >> 31
    return state & 0x7FFFFFFFFFFFFFFF


# --------------------------------------------------------------------------- sampling


class EpochSampler(Sampler):
    """Yields ``(epoch, index)`` for every sample, shuffled by ``(seed, epoch)`` when ``shuffle``.

    The order is the same on every process; Accelerate's ``BatchSamplerShard`` gives each process its
    batches of it. ``set_epoch`` is called by Accelerate's ``DataLoaderShard.set_epoch``; it runs in
    the main process, so it works with persistent workers too.
    """

    def __init__(self, num_samples: int, seed: int, shuffle: bool = True):
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator().manual_seed(mix_seed(self.seed, epoch))
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = self.epoch
        return ((epoch, index) for index in self.order(epoch))

    def __len__(self) -> int:
        return self.num_samples


class EpochKeyed(Dataset):
    """Adapts a dataset to ``(epoch, index)`` keys: ``sample(index, epoch)`` if it has one, else ``[index]``."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset
        self._sample = getattr(dataset, "sample", None)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        epoch, index = key
        if self._sample is not None:
            return self._sample(index, epoch)
        return self.dataset[index]


# --------------------------------------------------------------------------- images


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
    """Random crop with zero padding plus horizontal flip on uint8 images.

    The draws are a pure function of ``(seed, epoch, sample index)`` (``draws``), in vectorised integer
    arithmetic, and ``apply`` crops and flips a whole batch with one gather on any device. So the
    per-sample DataLoader path and the on-device loader augment every sample identically.
    """

    def __init__(self, padding: int = 4, flip: bool = True):
        self.padding = padding
        self.flip = flip

    def draws(self, seed: int, epoch: int, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(top, left, flip) for each sample index: crop offsets in [0, 2*padding] and a 0/1 flip."""
        epoch_key = hash32_int(hash32_int(seed & 0xFFFFFFFF) ^ (epoch & 0xFFFFFFFF))
        return self._split(hash32(epoch_key ^ (indices.long() & 0xFFFFFFFF)))

    def _split(self, bits):
        span = 2 * self.padding + 1
        top, left = bits % span, (bits >> 8) % span
        flip = (bits >> 16) & 1 if self.flip else bits * 0
        return top, left, flip

    def apply(self, images: torch.Tensor, top: torch.Tensor, left: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
        """Crop and flip a uint8 batch (B, C, H, W) with one flat gather, no padded copy: source pixels
        outside the image are the zero padding. Returns a contiguous NCHW batch."""
        batch, channels, height, width = images.shape
        pad, device = self.padding, images.device
        rows = top.view(-1, 1) - pad + torch.arange(height, device=device)
        columns = torch.arange(width, device=device)
        columns = torch.where(flip.view(-1, 1).bool(), width - 1 - columns, columns) + left.view(-1, 1) - pad
        inside = ((rows >= 0) & (rows < height)).view(batch, 1, height, 1) & ((columns >= 0) & (columns < width)).view(batch, 1, 1, width)
        source = rows.clamp(0, height - 1).view(batch, height, 1) * width + columns.clamp(0, width - 1).view(batch, 1, width)
        cropped = images.flatten(2).gather(2, source.view(batch, 1, -1).expand(batch, channels, -1))
        return cropped.view(batch, channels, height, width).masked_fill_(~inside, 0)

    def __call__(self, image: torch.Tensor, seed: int, epoch: int, index: int) -> torch.Tensor:
        """One CHW image: the same result as ``apply`` on a batch of one, by plain slicing (much faster)."""
        epoch_key = hash32_int(hash32_int(seed & 0xFFFFFFFF) ^ (epoch & 0xFFFFFFFF))
        top, left, flip = self._split(hash32_int(epoch_key ^ (index & 0xFFFFFFFF)))
        _, height, width = image.shape
        pad = self.padding
        padded = torch.nn.functional.pad(image, (pad, pad, pad, pad)) if pad else image
        cropped = padded[:, top : top + height, left : left + width]
        return cropped.flip(-1) if flip else cropped


class ImageClassification(Dataset):
    """Images as uint8 CHW tensors plus labels; ``[i]`` is the plain normalised image for evaluation,
    ``sample(i, epoch)`` the augmented one for training (randomness from ``(seed, epoch, i)`` only).

    ``images`` is either a uint8 tensor (N, C, H, W) held in memory, or a list of file paths decoded on
    access (and resized to ``image_size`` when they differ); ``cache_dir`` is where the on-device loader
    may keep them decoded.
    """

    def __init__(
        self,
        images: torch.Tensor | list[str],
        labels: list[int] | torch.Tensor,
        classes: list[str],
        *,
        image_size: int = 32,
        augment: CropFlip | None = None,
        seed: int = 0,
        mean: tuple[float, ...] = CIFAR10_MEAN,
        std: tuple[float, ...] = CIFAR10_STD,
        cache_dir: str | None = None,
    ):
        self.images = images
        self.labels = torch.as_tensor(labels, dtype=torch.long)
        self.classes = classes
        self.image_size = image_size
        self.augment = augment
        self.seed = seed
        self.mean = torch.tensor(mean).view(-1, 1, 1) * 255
        self.std = torch.tensor(std).view(-1, 1, 1) * 255
        self.cache_dir = cache_dir  # where --data-on-device may cache the decoded files (the data folder)

    def __len__(self) -> int:
        return len(self.labels)

    def _load(self, index: int) -> torch.Tensor:
        if isinstance(self.images, torch.Tensor):
            return self.images[index]
        return decode_image_file(self.images[index], self.image_size)

    def _normalise(self, image: torch.Tensor) -> torch.Tensor:
        return (image.float() - self.mean) / self.std

    def __getitem__(self, index: int):
        return self._normalise(self._load(index)), self.labels[index]

    def sample(self, index: int, epoch: int):
        image = self._load(index)
        if self.augment is not None:
            image = self.augment(image, self.seed, epoch, index)
        return self._normalise(image), self.labels[index]


def decode_image_file(path: str, image_size: int) -> torch.Tensor:
    """An image file as a uint8 RGB CHW tensor of ``image_size`` x ``image_size`` (resized when it differs)."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as image:
        image = image.convert("RGB")
        if image.size != (image_size, image_size):
            image = image.resize((image_size, image_size), Image.Resampling.BILINEAR)
        return torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous()


def synthetic_images(
    num_train: int, num_eval: int, *, num_classes: int = 10, image_size: int = 32, seed: int = 0
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """uint8 images of CIFAR shape whose class is written in their mean colour (so it survives crop
    and flip): noise plus a per-class colour offset. Learnable in a few steps; for tests and benchmarks."""
    generator = torch.Generator().manual_seed(mix_seed(seed, 0x5EED))
    palette = torch.randint(-60, 61, (num_classes, 3, 1, 1), generator=generator).float()

    def make(count: int) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.randint(0, num_classes, (count,), generator=generator)
        noise = torch.randn(count, 3, image_size, image_size, generator=generator) * 40 + 128
        return (noise + palette[labels]).clamp(0, 255).to(torch.uint8), labels

    return make(num_train), make(num_eval)


def cifar10_arrays(data_dir: str, train: bool) -> tuple[torch.Tensor, list[int], list[str]]:
    """CIFAR-10 from torchvision (downloaded into ``data_dir`` when missing) as uint8 NCHW tensors."""
    from torchvision.datasets import CIFAR10

    try:
        dataset = CIFAR10(root=data_dir, train=train, download=True)
    except (OSError, RuntimeError) as err:  # URLError is an OSError; md5 mismatch is a RuntimeError
        reason = str(getattr(err, "reason", err)).splitlines()[0]
        raise ConfigError(
            f"CIFAR-10 is not in --data-dir {data_dir!r} and could not be downloaded ({reason}); "
            "put the python-version batches there, use --dataset imagefolder --data-dir DIR, "
            "or --dataset synthetic"
        ) from None
    images = torch.from_numpy(dataset.data).permute(0, 3, 1, 2).contiguous()
    return images, list(dataset.targets), list(dataset.classes)


def scan_image_folder(data_dir: str) -> dict[str, tuple[list[str], list[int], list[str]]]:
    """Check a ``train/<class>/*`` + ``test/<class>/*`` tree and list its files, or raise ConfigError."""
    root = Path(data_dir)
    if not root.is_dir():
        raise ConfigError(f"--data-dir {data_dir!r} is not a directory (expected train/<class>/* and test/<class>/*)")
    splits = {}
    for split in ("train", "test"):
        split_dir = root / split
        if not split_dir.is_dir():
            raise ConfigError(f"--data-dir {data_dir!r} has no {split}/ folder (expected train/<class>/* and test/<class>/*)")
        classes = sorted(p.name for p in split_dir.iterdir() if p.is_dir())
        if not classes:
            raise ConfigError(f"--data-dir {data_dir!r}: {split}/ has no class folders (expected {split}/<class>/*)")
        paths, labels = [], []
        for label, name in enumerate(classes):
            files = sorted(str(p) for p in (split_dir / name).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
            if not files:
                raise ConfigError(f"--data-dir {data_dir!r}: {split}/{name}/ holds no images ({', '.join(IMAGE_SUFFIXES)})")
            paths += files
            labels += [label] * len(files)
        splits[split] = (paths, labels, classes)
    if splits["train"][2] != splits["test"][2]:
        raise ConfigError(
            f"--data-dir {data_dir!r}: train/ and test/ have different class folders "
            f"({len(splits['train'][2])} vs {len(splits['test'][2])})"
        )
    return splits


# --------------------------------------------------------------------------- loaders


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_num_workers() -> int:
    """Loader workers per process: the CPUs this process may use, less one for the training loop, at most 8."""
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(0, min(8, available_cpus() // local_processes - 1))


def loader_options(num_workers: int, pin_memory: bool, prefetch_factor: int = 4) -> dict:
    """Worker processes stay alive across epochs and prefetch; host memory is pinned for CUDA copies."""
    options = {"num_workers": num_workers, "pin_memory": pin_memory}
    if num_workers > 0:
        options.update(persistent_workers=True, prefetch_factor=prefetch_factor)
    return options


def train_loader(dataset: Dataset, *, batch_size: int, seed: int, **options) -> DataLoader:
    """Shuffled per epoch, last incomplete batch dropped; prepare it with Accelerate to shard it.
    ``options``: see :func:`loader_options`."""
    return DataLoader(
        EpochKeyed(dataset),
        batch_size=batch_size,
        sampler=EpochSampler(len(dataset), seed=seed, shuffle=True),
        drop_last=True,
        **loader_options(**options),
    )


def eval_loader(dataset: Dataset, *, batch_size: int, **options) -> DataLoader:
    """Every sample once, in order; ``gather_for_metrics`` drops the duplicates that padding adds."""
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, drop_last=False, **loader_options(**options))


IMAGE_DATASETS = ("cifar10", "imagefolder", "synthetic")


def image_datasets(
    name: str,
    data_dir: str | None,
    *,
    seed: int,
    image_size: int = 32,
    synthetic_sizes: tuple[int, int] = (2048, 512),
) -> tuple[ImageClassification, ImageClassification]:
    """(train, eval) image datasets: ``cifar10`` (torchvision, downloaded once by the main process),
    ``imagefolder`` (``data_dir/{train,test}/<class>/*``) or ``synthetic``. Training samples get
    crop (padding 4) + flip; both are normalised with CIFAR-10 statistics."""
    augment = CropFlip(padding=4, flip=True)
    cache_dir = None
    if name == "cifar10":
        root = data_dir or "data"
        (train_images, train_labels, classes), (eval_images, eval_labels, _) = on_main_process_first(
            lambda: (cifar10_arrays(root, train=True), cifar10_arrays(root, train=False))
        )
    elif name == "imagefolder":
        if not data_dir:
            raise ConfigError("--dataset imagefolder needs --data-dir DIR holding train/<class>/* and test/<class>/*")
        splits = scan_image_folder(data_dir)
        (train_images, train_labels, classes), (eval_images, eval_labels, _) = splits["train"], splits["test"]
        cache_dir = data_dir
    elif name == "synthetic":
        (train_images, train_labels), (eval_images, eval_labels) = synthetic_images(
            *synthetic_sizes, image_size=image_size, seed=seed
        )
        classes = [f"class{i}" for i in range(10)]
    else:
        raise ConfigError(f"--dataset {name!r} is invalid: choose one of {', '.join(IMAGE_DATASETS)}")
    common = {"image_size": image_size, "seed": seed, "cache_dir": cache_dir}
    return (
        ImageClassification(train_images, train_labels, classes, augment=augment, **common),
        ImageClassification(eval_images, eval_labels, classes, **common),
    )
