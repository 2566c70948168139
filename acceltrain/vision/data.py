"""Image datasets: uint8 CHW images with their labels, augmented on the fly (:mod:`.augment`), from CIFAR-10,
ImageFolder trees (every file checked first: :mod:`.images`), a Hub dataset or synthetic images."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch.utils.data import Dataset

from acceltrain.config.options import ConfigError, first_line
from acceltrain.data.loaders import mix_seed
from acceltrain.runtime.distributed import on_main_process_first
from acceltrain.runtime.logs import show_progress
from acceltrain.vision.augment import CropFlip
from acceltrain.vision.images import decode_image_file, unreadable_reason
from acceltrain.vision.names import IMAGE_DATASETS, is_hub_dataset

# the plain logger: a recipe reads its data before Accelerate's state exists, which accelerate's logger needs
logger = logging.getLogger(__name__)

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp")
CHECK_BAR_MIN_FILES = 10_000  # the image-file check of a smaller tree is over before a bar would tell anything


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
        self.cache_dir = (
            cache_dir  # where --data-on-device caches decoded files; None: $ACCELTRAIN_CACHE, else ~/.cache/acceltrain
        )
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

    def device_loader(
        self, *, batch_size: int, seed: int, device, process_index: int, num_processes: int, channels_last: bool
    ):
        """``--data-on-device``: the whole set on ``device``, batches gathered and augmented there (see
        :class:`acceltrain.vision.DeviceImageLoader`)."""
        from acceltrain.vision.device_loader import DeviceImageLoader

        return DeviceImageLoader.from_dataset(
            self,
            batch_size=batch_size,
            seed=seed,
            device=device,
            process_index=process_index,
            num_processes=num_processes,
            channels_last=channels_last,
            cache_dir=self.cache_dir,
            progress=self.progress,
        )

    def decoded(self) -> ImageClassification:
        """This dataset with its image files decoded once into one uint8 tensor (cached in ``cache_dir``),
        for repeated evaluation under ``--data-on-device``; itself when the images are in memory already."""
        if isinstance(self.images, torch.Tensor):
            return self
        import copy

        from acceltrain.vision.device_loader import decoded_images

        decoded = copy.copy(self)
        decoded.images = decoded_images(self.images, self.image_size, self.cache_dir, self.progress)
        return decoded


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
            raise ConfigError(
                f"--data-dir {data_dir!r} has no {split}/ folder (expected train/<class>/* and test/<class>/*)"
            )
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
                raise ConfigError(
                    f"--data-dir {data_dir!r}: {split}/{name}/ holds no images ({', '.join(IMAGE_SUFFIXES)})"
                )
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
        raise ConfigError(
            f"--data-dir {str(root)!r}: {count}: {named}{', ...' if len(bad) > 3 else ''}; "
            "remove or replace them, or pass --skip-bad-images to train without them"
        )
    if os.environ.get("RANK", "0") == "0":
        logger.warning(f"--skip-bad-images: skipped {count} in {str(root)!r}: {named}{', ...' if len(bad) > 3 else ''}")
    kept = {}
    for split, (paths, labels, classes) in splits.items():
        pairs = [(path, label) for path, label in zip(paths, labels, strict=True) if path not in bad]
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
    from acceltrain.vision.hub_datasets import hub_image_arrays

    augment = CropFlip() if augment is None else augment
    if is_hub_dataset(name):
        if data_dir:
            raise ConfigError(
                f"--data-dir is not used by the Hub dataset {name!r}, which lives in the HF cache (HF_HOME): leave it "
                "out"
            )
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
            f"--dataset {name!r} is invalid: choose one of {', '.join(IMAGE_DATASETS)}, or a Hub dataset as "
            "namespace/name (e.g. uoft-cs/cifar10)"
        )
    common = {"image_size": image_size, "seed": seed, "progress": progress}
    return (
        ImageClassification(train_images, train_labels, classes, augment=augment, **common),
        ImageClassification(eval_images, eval_labels, classes, **common),
    )
