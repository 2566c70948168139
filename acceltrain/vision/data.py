"""Image datasets and augmentation: uint8 CHW images, crop/flip draws keyed on ``(seed, epoch, index)``
(so every loader, process count and resume sees the same augmented sample), CIFAR-10, ImageFolder trees
and synthetic images."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import torch
from torch.utils.data import Dataset

from ..data import mix_seed
from ..distributed import on_main_process_first
from ..logs import show_progress
from ..options import ConfigError, first_line
from .names import FLIPS, IMAGE_DATASETS, PADDING_MODES, is_hub_dataset

# the plain logger: a recipe reads its data before Accelerate's state exists, which accelerate's logger needs
logger = logging.getLogger(__name__)

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp")
CHECK_BAR_MIN_FILES = 10_000  # the image-file check of a smaller tree is over before a bar would tell anything


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
            raise ConfigError(f"crop padding mode {padding_mode!r} is invalid: choose one of {', '.join(PADDING_MODES)}")
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
                f"crop padding {self.padding} is invalid for reflect padding of {height}x{width} images: must be < {min(height, width)}"
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
        inside = ((rows >= 0) & (rows < height)).view(batch, 1, height, 1) & ((columns >= 0) & (columns < width)).view(batch, 1, 1, width)
        source = rows.clamp(0, height - 1).view(batch, height, 1) * width + columns.clamp(0, width - 1).view(batch, 1, width)
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


class ImageClassification(Dataset):
    """Images as uint8 CHW tensors plus labels; ``[i]`` is the plain normalised image for evaluation,
    ``sample(i, epoch)`` the augmented one for training (randomness from ``(seed, epoch, i)`` only).

    ``images`` is either a uint8 tensor (N, C, H, W) held in memory, or a list of file paths decoded on
    access (and resized to ``image_size`` when they differ); ``cache_dir`` is where the on-device loader
    may keep them decoded; ``progress`` (``--progress``: True, False or None) whether decoding them shows a bar.
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
        progress: bool | None = None,
    ):
        self.images = images
        self.labels = torch.as_tensor(labels, dtype=torch.long)
        self.classes = classes
        self.image_size = image_size
        self.augment = augment
        self.seed = seed
        self.mean = torch.tensor(mean).view(-1, 1, 1) * 255
        self.std = torch.tensor(std).view(-1, 1, 1) * 255
        self.cache_dir = cache_dir  # where --data-on-device caches decoded files; None: $ACCELTRAIN_CACHE, else ~/.cache/acceltrain
        self.progress = progress

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

    def device_loader(self, *, batch_size: int, seed: int, device, process_index: int, num_processes: int, channels_last: bool):
        """``--data-on-device``: the whole set on ``device``, batches gathered and augmented there (see
        :class:`acceltrain.vision.DeviceImageLoader`)."""
        from .device_loader import DeviceImageLoader

        return DeviceImageLoader.from_dataset(
            self, batch_size=batch_size, seed=seed, device=device, process_index=process_index,
            num_processes=num_processes, channels_last=channels_last, cache_dir=self.cache_dir, progress=self.progress,
        )

    def decoded(self) -> "ImageClassification":
        """This dataset with its image files decoded once into one uint8 tensor (cached in ``cache_dir``),
        for repeated evaluation under ``--data-on-device``; itself when the images are in memory already."""
        if isinstance(self.images, torch.Tensor):
            return self
        import copy

        from .device_loader import decoded_images

        decoded = copy.copy(self)
        decoded.images = decoded_images(self.images, self.image_size, self.cache_dir, self.progress)
        return decoded


class UnreadableImage(ConfigError):
    """An image file that cannot be decoded, found at its first read (damage the scan cannot see). One line
    also when raised in a DataLoader worker, which re-raises it with the worker's traceback as its text."""

    def __init__(self, message: str):
        if "Original Traceback" in message:  # torch's ExceptionWrapper.reraise: keep the original one line
            message = message.rstrip().splitlines()[-1].removeprefix(f"{__name__}.").removeprefix("UnreadableImage: ")
        super().__init__(message)


def decode_image_file(path: str, image_size: int) -> torch.Tensor:
    """An image file as a uint8 RGB CHW tensor of ``image_size`` x ``image_size`` (resized when it differs)."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            return torch.from_numpy(rgb_chw(image, image_size))
    except (OSError, SyntaxError, ValueError) as err:  # PIL reports damaged data as any of these
        raise UnreadableImage(f"image file {path!r} cannot be decoded ({first_line(err)}): remove or replace it") from None


def rgb_chw(image, image_size: int):
    """A PIL image as a uint8 RGB (3, S, S) numpy array, resized (bilinear) when its size is not S x S: the
    one conversion of image files and Hub datasets' images alike. 16-bit grayscale (PIL's ``I;16`` and ``I``
    modes) is scaled to 8 bits first: ``convert`` would clip it, nearly every pixel white."""
    import numpy as np
    from PIL import Image

    if image.mode.startswith("I"):
        image = Image.fromarray((np.asarray(image).clip(0, 65535) >> 8).astype(np.uint8))
    image = image.convert("RGB")
    if image.size != (image_size, image_size):
        image = image.resize((image_size, image_size), Image.Resampling.BILINEAR)
    return np.ascontiguousarray(np.asarray(image).transpose(2, 0, 1))


def unreadable_reason(path: str) -> str | None:
    """Why ``path`` is no usable image, or None. Cheap enough for every file of a tree: ``stat`` (a symlink
    loop, a dangling link, a folder named like an image, an empty file), the header (not an image), and the
    end marker of JPEG and PNG files (a copy cut short); only a file without that marker, or of another
    format, is decoded in full, to be sure."""
    from PIL import Image

    try:
        status = os.stat(path)
        if not stat.S_ISREG(status.st_mode):
            return "not a file"
        if status.st_size == 0:
            return "empty file"
        with Image.open(path) as image:
            if not _ends_completely(path, image.format):
                image.load()
    except Image.UnidentifiedImageError:
        return "not an image"
    except (OSError, SyntaxError, ValueError) as err:
        return first_line(err)
    return None


def _ends_completely(path: str, image_format: str | None) -> bool:
    if image_format not in ("JPEG", "PNG"):
        return False
    with open(path, "rb") as file:
        file.seek(max(0, os.path.getsize(path) - 64))
        tail = file.read()
    return b"\xff\xd9" in tail if image_format == "JPEG" else tail.endswith(b"IEND\xaeB`\x82")


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
        reason = first_line(getattr(err, "reason", err))
        raise ConfigError(
            f"CIFAR-10 is not in --data-dir {data_dir!r} and could not be downloaded ({reason}); "
            "put the python-version batches there, use --dataset imagefolder --data-dir DIR, "
            "or --dataset synthetic"
        ) from None
    images = torch.from_numpy(dataset.data).permute(0, 3, 1, 2).contiguous()
    return images, list(dataset.targets), list(dataset.classes)


def scan_image_folder(
    data_dir: str, skip_bad_images: bool = False, progress: bool | None = None
) -> dict[str, tuple[list[str], list[int], list[str]]]:
    """Check a ``train/<class>/*`` + ``test/<class>/*`` tree and list its files, or raise ConfigError.

    Every file is checked (:func:`unreadable_reason`) before any training, so a bad one stops the run at
    once with one line, not after an epoch; ``skip_bad_images`` leaves them out and says how many; ``progress``
    as ``--progress`` (see :func:`acceltrain.show_progress`)."""
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
        if len(classes) == 1:
            raise ConfigError(
                f"--data-dir {data_dir!r}: {split}/ has only one class folder {classes[0]!r}; a classifier needs "
                f"at least 2 (expected {split}/<class>/* for each class)"
            )
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
    return _without_bad_images(splits, root, skip_bad_images, progress)


def _without_bad_images(splits: dict, root: Path, skip: bool, progress: bool | None) -> dict:
    """``splits`` after checking every file, with a progress bar on big trees (CIFAR-10's 60,000 JPEGs: a
    few seconds); bad files are one ConfigError naming them, or left out when ``skip``."""
    from tqdm.auto import tqdm

    everything = [path for paths, _, _ in splits.values() for path in paths]
    quiet = not show_progress(progress) or len(everything) < CHECK_BAR_MIN_FILES or os.environ.get("RANK", "0") != "0"
    checked = tqdm(everything, desc="checking image files", unit="file", leave=False, disable=quiet)
    bad = {path: reason for path in checked if (reason := unreadable_reason(path)) is not None}
    if not bad:
        return splits
    named = ", ".join(f"{os.path.relpath(path, root)} ({reason})" for path, reason in list(bad.items())[:3])
    count = f"{len(bad)} unreadable image file{'s' if len(bad) > 1 else ''}"
    if not skip:
        raise ConfigError(f"--data-dir {str(root)!r}: {count}: {named}{', ...' if len(bad) > 3 else ''}; "
                          "remove or replace them, or pass --skip-bad-images to train without them")
    if os.environ.get("RANK", "0") == "0":
        logger.warning(f"--skip-bad-images: skipped {count} in {str(root)!r}: {named}{', ...' if len(bad) > 3 else ''}")
    kept = {}
    for split, (paths, labels, classes) in splits.items():
        pairs = [(path, label) for path, label in zip(paths, labels) if path not in bad]
        kept[split] = ([path for path, _ in pairs], [label for _, label in pairs], classes)
    return kept


def image_datasets(
    name: str,
    data_dir: str | None,
    *,
    seed: int,
    image_size: int = 32,
    synthetic_sizes: tuple[int, int] = (2048, 512),
    skip_bad_images: bool = False,
    augment: CropFlip | None = None,
    progress: bool | None = None,
) -> tuple[ImageClassification, ImageClassification]:
    """(train, eval) image datasets: ``cifar10`` (torchvision, downloaded once by the main process),
    ``imagefolder`` (``data_dir/{train,test}/<class>/*``), ``synthetic``, or a Hub dataset ``namespace/name``
    with an image and a ClassLabel column (``uoft-cs/cifar10``; see :mod:`.hub_datasets`). Training samples get
    ``augment`` (default: crop with zero padding 4 + random flip); both are normalised with CIFAR-10 statistics.
    ``progress`` (``--progress``) decides the image-file check's and decode's bars."""
    from .hub_datasets import hub_image_arrays

    augment = CropFlip() if augment is None else augment
    if is_hub_dataset(name):
        if data_dir:
            raise ConfigError(f"--data-dir is not used by the Hub dataset {name!r}, which lives in the HF cache (HF_HOME): leave it out")
        (train_images, train_labels, classes), (eval_images, eval_labels, _) = hub_image_arrays(name, image_size)
    elif name == "cifar10":
        root = data_dir or "data"
        (train_images, train_labels, classes), (eval_images, eval_labels, _) = on_main_process_first(
            lambda: (cifar10_arrays(root, train=True), cifar10_arrays(root, train=False))
        )
    elif name == "imagefolder":
        if not data_dir:
            raise ConfigError("--dataset imagefolder needs --data-dir DIR holding train/<class>/* and test/<class>/*")
        splits = scan_image_folder(data_dir, skip_bad_images, progress)
        (train_images, train_labels, classes), (eval_images, eval_labels, _) = splits["train"], splits["test"]
    elif name == "synthetic":
        (train_images, train_labels), (eval_images, eval_labels) = synthetic_images(
            *synthetic_sizes, image_size=image_size, seed=seed
        )
        classes = [f"class{i}" for i in range(10)]
    else:
        raise ConfigError(
            f"--dataset {name!r} is invalid: choose one of {', '.join(IMAGE_DATASETS)}, or a Hub dataset as namespace/name "
            "(e.g. uoft-cs/cifar10)"
        )
    common = {"image_size": image_size, "seed": seed, "progress": progress}
    return (
        ImageClassification(train_images, train_labels, classes, augment=augment, **common),
        ImageClassification(eval_images, eval_labels, classes, **common),
    )
