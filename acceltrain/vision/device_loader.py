"""``--data-on-device``: the whole uint8 training set lives on the training device and every batch is
gathered, cropped, flipped and normalised there, so the host does no per-sample work at all.

It is a drop-in for ``train_loader(...)`` prepared by Accelerate: the same global order per epoch
(``EpochSampler``), the same sharding (process r's i-th batch is global batch ``i*P + r``, last
incomplete global batches dropped), the same augmentation (``CropFlip`` draws keyed on
``(seed, epoch, index)``) and normalisation. So it yields the very same tensors, and a run can switch
loaders, or resume mid-epoch with the other one, without changing what the model sees.

ImageFolder files are decoded once into a safetensors cache in ``$ACCELTRAIN_CACHE`` (default
``~/.cache/acceltrain``; keyed on the files' paths, sizes and mtimes and the image size, and checked
against a content hash before use), so later runs start in seconds instead of re-decoding every JPEG.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from accelerate.logging import get_logger
from accelerate.state import GradientState

from acceltrain.accelerate_compat import LoaderStateMixin
from acceltrain.config.options import ConfigError, first_line
from acceltrain.data.loaders import EpochSampler
from acceltrain.runtime.distributed import on_main_process_first, process_state
from acceltrain.runtime.logs import show_progress
from acceltrain.vision.augment import CropFlip
from acceltrain.vision.images import decode_image_file

logger = get_logger(__name__)

CACHE_ENV = "ACCELTRAIN_CACHE"


class DeviceImageLoader(LoaderStateMixin):
    """Ready training batches ``(float32 normalised images, int64 labels)`` made on ``device``.

    Subclasses Accelerate's loader state (``accelerate_compat.LoaderStateMixin``) and registers itself with
    ``GradientState`` while iterated, exactly as a prepared ``DataLoaderShard`` does, so ``Accelerator.accumulate``
    syncs at the end of each epoch without this loader going through ``accelerator.prepare``.
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        *,
        batch_size: int,
        seed: int,
        mean: torch.Tensor,
        std: torch.Tensor,
        augment: CropFlip | None = None,
        augment_seed: int = 0,
        process_index: int = 0,
        num_processes: int = 1,
        channels_last: bool = False,
    ):
        if not 0 <= process_index < num_processes:
            raise ValueError(f"process_index {process_index} is not in [0, {num_processes})")
        device = images.device
        self.images = images  # uint8 (N, C, H, W) on the training device
        self.labels = labels.to(device)
        self.batch_size = batch_size
        self.seed = seed
        self.mean = mean.to(device).view(1, -1, 1, 1)  # already scaled by 255, like ImageClassification's
        self.std = std.to(device).view(1, -1, 1, 1)
        self.augment = augment
        self.augment_seed = augment_seed  # the dataset's seed, which keys its draws; ``seed`` keys the order
        self.process_index = process_index
        self.num_processes = num_processes
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.sampler = EpochSampler(len(images), seed=seed, shuffle=True)
        self.epoch = 0
        self.gradient_state = GradientState()
        self._drop_last = True  # read by LoaderStateMixin.begin: no padded remainder to drop in gather_for_metrics

    @classmethod
    def from_dataset(
        cls,
        dataset,
        *,
        batch_size: int,
        seed: int,
        device: torch.device | str,
        process_index: int,
        num_processes: int,
        channels_last: bool = False,
        cache_dir: str | os.PathLike | None = None,
        progress: bool | None = None,
    ) -> DeviceImageLoader:
        """The loader for one of the project's image datasets: in-memory uint8 images are moved to
        ``device``; file lists are decoded once into a safetensors cache in ``cache_dir`` (default:
        :func:`decode_cache_dir`), with a bar if ``progress`` (``--progress``) says so."""
        if isinstance(dataset.images, torch.Tensor):
            images = dataset.images
        else:
            images = decoded_images(list(dataset.images), dataset.image_size, cache_dir, progress)
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ConfigError(
                f"--data-on-device needs uint8 images of shape (N, C, H, W), got {images.dtype} {tuple(images.shape)}"
            )
        return cls(
            images.to(device),
            dataset.labels,
            batch_size=batch_size,
            seed=seed,
            mean=dataset.mean,
            std=dataset.std,
            augment=dataset.augment,
            augment_seed=dataset.seed,
            process_index=process_index,
            num_processes=num_processes,
            channels_last=channels_last,
        )

    # ---- the DataLoader interface the loop uses

    def __len__(self) -> int:
        """Batches per process per epoch: only global batches that give every process a full batch."""
        return len(self.images) // (self.batch_size * self.num_processes)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self._iterate(skip=0)

    def skip_first(self, num_batches: int) -> _RestOfEpoch:
        """The remaining batches of the current epoch after its first ``num_batches`` (exact mid-epoch resume;
        what ``accelerator.skip_first_batches`` does for a prepared DataLoader)."""
        return _RestOfEpoch(self, num_batches)

    # ---- batches

    def epoch_indices(self, epoch: int) -> torch.Tensor:
        """(batches, batch_size) sample indices of this process for ``epoch``, on the device: row i is
        global batch ``i * num_processes + process_index`` of the epoch's global order."""
        order = torch.tensor(self.sampler.order(epoch), dtype=torch.long)
        count, size, processes = len(self), self.batch_size, self.num_processes
        mine = order[: count * processes * size].view(count, processes, size)[:, self.process_index]
        return mine.to(self.images.device, non_blocking=True)

    def make_batch(
        self, indices: torch.Tensor, draws: tuple[torch.Tensor, ...] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather, crop/flip, lay out and normalise one batch: uint8 until the last step (4x less traffic)."""
        images = self.images.index_select(0, indices)  # on CPU 30x faster than images[indices]
        if draws is not None:
            images = self.augment.apply(images, *draws)
        # .float() then in-place ops: a mixed uint8-float op takes a slow path on CPU (13 ms vs 0.3 ms a batch)
        images = images.contiguous(memory_format=self.memory_format).float()
        return images.sub_(self.mean).div_(self.std), self.labels.index_select(0, indices)

    def _iterate(self, skip: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """What ``DataLoaderShard.__iter__`` does with the mixin: ``begin()``, ``end_of_dataloader`` set
        before the last batch is yielded, ``end()``; and, like it, move to the next epoch after a full pass.
        The crop/flip draws of the whole epoch are computed at once (a handful of kernels per epoch)."""
        epoch = self.epoch
        batches = self.epoch_indices(epoch)[skip:]
        draws = self.augment.draws(self.augment_seed, epoch, batches) if self.augment is not None else None
        self.begin()
        try:
            for position in range(len(batches)):
                if position == len(batches) - 1:
                    self.end_of_dataloader = True
                yield self.make_batch(batches[position], None if draws is None else tuple(d[position] for d in draws))
            self.epoch = epoch + 1
        finally:  # also when the consumer stops early, so the GradientState does not keep a stale loader
            self.end()


class _RestOfEpoch:
    """What ``DeviceImageLoader.skip_first`` returns: an iterable with a length, like a skipped DataLoader."""

    def __init__(self, loader: DeviceImageLoader, skip: int):
        self.loader = loader
        self.skip = skip

    def __len__(self) -> int:
        return max(0, len(self.loader) - self.skip)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.loader._iterate(self.skip)


# --------------------------------------------------------------------------- the decode cache


def decoded_images(
    paths: list[str], image_size: int, cache_dir: str | os.PathLike | None = None, progress: bool | None = None
) -> torch.Tensor:
    """All ``paths`` as one uint8 (N, 3, S, S) tensor, decoded once and cached as safetensors in
    ``cache_dir`` (default: :func:`decode_cache_dir`).

    The main process decodes while the others wait (:func:`on_main_process_first`), then they read its
    cache; it says where the cache goes and, if ``progress`` (``--progress``, see :func:`acceltrain.show_progress`) says
    so, shows a bar while it decodes (CIFAR-10's 60,000 JPEGs: about 40 s, 184 MB). The cache file is named after the
    folder and image size and holds a fingerprint of every file's path, size and mtime: a changed, added or removed file
    makes it stale, and it is rewritten; so is one that fails :func:`_read_cache`'s checks.
    """
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    state = process_state()
    cache_file = _writable(decode_cache_dir(cache_dir)) / f"decoded-{_folder_key(paths, image_size)}.safetensors"
    fingerprint = _fingerprint(paths, image_size)
    shape = (len(paths), 3, image_size, image_size)

    def cached_or_decoded() -> torch.Tensor:
        cached, mismatch = _read_cache(cache_file, fingerprint, shape)
        if cached is not None:
            logger.info(f"using the {len(paths)} images decoded in {cache_file}")
            return cached
        if mismatch is None:
            megabytes = len(paths) * 3 * image_size**2 / 1e6
            logger.info(
                f"decoding {len(paths)} image files once into {cache_file} ({megabytes:.1f} MB; {CACHE_ENV} sets the "
                "folder)"
            )
        else:
            logger.warning(
                f"the decoded-image cache {cache_file} does not match ({mismatch}): decoding the {len(paths)} images "
                "again"
            )
        images = torch.empty(shape, dtype=torch.uint8)
        bar = tqdm(
            paths,
            desc="decoding images",
            unit="file",
            leave=False,
            dynamic_ncols=True,
            disable=not (state.is_main_process and show_progress(progress)),
        )
        for position, path in enumerate(bar):
            images[position] = decode_image_file(path, image_size)
        partial = cache_file.with_name(f".{cache_file.name}.{os.getpid()}.tmp")
        save_file(
            {"images": images}, str(partial), metadata={"fingerprint": fingerprint, "sha256": _content_hash(images)}
        )
        os.replace(partial, cache_file)  # readers never see a half-written cache
        return images

    return on_main_process_first(cached_or_decoded)


def decode_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where decoded images are cached: ``cache_dir`` when given, else ``$ACCELTRAIN_CACHE``, else
    ``$XDG_CACHE_HOME/acceltrain`` (``~/.cache/acceltrain``). Like ``HF_HOME`` it is the machine's
    setting, not the run's, and never the data folder, which may be shared, read-only or backed up."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "acceltrain"


def _writable(root: Path) -> Path:
    try:
        root.mkdir(parents=True, exist_ok=True)
        writable = os.access(root, os.W_OK | os.X_OK)
    except OSError:
        writable = False
    if not writable:
        raise ConfigError(f"the decoded-image cache {str(root)!r} is not a writable folder: set {CACHE_ENV} to one")
    return root


def _read_cache(cache_file: Path, fingerprint: str, shape: tuple[int, ...]) -> tuple[torch.Tensor | None, str | None]:
    """(the cached images, None) if the file was made from exactly these files, holds uint8 images of
    ``shape`` and they have the content hash it was written with; else (None, what differs), or (None, None)
    when there is no cache yet. A file that only looks right (edited, damaged, from another version) is
    never trained on: the fingerprint names the files, not what the file holds."""
    from safetensors import SafetensorError, safe_open

    if not cache_file.exists():
        return None, None
    try:
        with safe_open(str(cache_file), framework="pt") as cached:
            metadata = cached.metadata() or {}
            if not {"fingerprint", "sha256"} <= metadata.keys() or "images" not in cached.keys():
                return None, "no fingerprint and content hash: an older acceltrain's file, or another program's"
            if metadata["fingerprint"] != fingerprint:
                return None, "made from other image files, or before they changed"
            found = cached.get_slice("images")
            if (found.get_dtype(), tuple(found.get_shape())) != ("U8", shape):
                return None, f"it holds {found.get_dtype()} {tuple(found.get_shape())}, these files make U8 {shape}"
            images = cached.get_tensor("images")
    except (OSError, SafetensorError) as err:  # truncated or foreign file
        return None, f"unreadable: {first_line(err)}"
    if _content_hash(images) != metadata["sha256"]:
        return None, "its content hash differs: changed or damaged since it was written"
    return images, None


def _content_hash(images: torch.Tensor) -> str:
    """sha256 of every byte, no sample: about 0.13 s for CIFAR-10's 150 MB train set, nothing next to decoding it
    (40 s)."""
    return hashlib.sha256(images.contiguous().numpy()).hexdigest()


def _folder_key(paths: list[str], image_size: int) -> str:
    folder = os.path.commonpath([os.path.abspath(p) for p in paths]) if paths else ""
    return f"{Path(folder).name or 'images'}-{image_size}px-{hashlib.sha256(folder.encode()).hexdigest()[:12]}"


def _fingerprint(paths: list[str], image_size: int) -> str:
    digest = hashlib.sha256(f"image_size={image_size}\n".encode())
    for path in paths:
        info = os.stat(path)
        digest.update(f"{os.path.abspath(path)}\t{info.st_size}\t{info.st_mtime_ns}\n".encode())
    return digest.hexdigest()
