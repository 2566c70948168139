"""``--data-on-device``: the device loader yields exactly what the Accelerate-prepared DataLoader path
yields (order, sharding, augmentation, normalisation, resume), keeps Accelerate's accumulation
bookkeeping, and decodes an image folder once into a cache that notices changed files."""

from __future__ import annotations

import os

import pytest
import torch
from accelerate import Accelerator
from accelerate.data_loader import BatchSamplerShard
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from acceltrain import ConfigError
from acceltrain.data.loaders import train_loader
from acceltrain.vision import (
    CropFlip,
    DeviceImageLoader,
    ImageClassification,
    device_loader,
    image_datasets,
    synthetic_images,
)
from acceltrain.vision.images import decode_image_file

BATCH = 8


def identified_dataset(count: int = 75, seed: int = 1) -> ImageClassification:
    """Synthetic images whose label is their own index, so every yielded label names its sample.
    75 samples at batch 8: 9 global batches, so with 2 processes the 9th is dropped, as Accelerate does."""
    (images, _), _ = synthetic_images(count, 1, seed=0)
    return ImageClassification(
        images, torch.arange(count), [str(i) for i in range(count)], augment=CropFlip(), seed=seed
    )


def device_batches(dataset, *, epoch, processes=1, rank=0, skip=0, seed=5, **options):
    loader = DeviceImageLoader.from_dataset(
        dataset, batch_size=BATCH, seed=seed, device="cpu", process_index=rank, num_processes=processes, **options
    )
    loader.set_epoch(epoch)
    return list(loader.skip_first(skip) if skip else loader)


def dataloader_batches(dataset, *, epoch, processes=1, rank=0, skip=0, seed=5):
    """The DataLoader path sharded by hand exactly as ``accelerator.prepare`` shards it (split_batches=False)."""
    loader = train_loader(dataset, batch_size=BATCH, seed=seed, num_workers=0, pin_memory=False)
    loader.sampler.set_epoch(epoch)
    shard = BatchSamplerShard(loader.batch_sampler, num_processes=processes, process_index=rank)
    return list(DataLoader(loader.dataset, batch_sampler=shard))[skip:]


def assert_same_batches(ours, reference):
    assert len(ours) == len(reference) > 0
    for (images, labels), (expected_images, expected_labels) in zip(ours, reference, strict=True):
        assert images.dtype == torch.float32 and labels.dtype == torch.int64
        assert torch.equal(images, expected_images) and torch.equal(labels, expected_labels)


@pytest.mark.parametrize("processes,rank", [(1, 0), (2, 0), (2, 1)])
@pytest.mark.parametrize("skip", [0, 2])
def test_same_tensors_as_the_sharded_dataloader_path(processes, rank, skip):
    dataset = identified_dataset()
    for epoch in (0, 3):
        ours = device_batches(dataset, epoch=epoch, processes=processes, rank=rank, skip=skip)
        assert_same_batches(ours, dataloader_batches(dataset, epoch=epoch, processes=processes, rank=rank, skip=skip))


def test_same_tensors_as_a_dataloader_prepared_by_accelerate_including_skip_first_batches():
    """One process, the real thing: ``accelerator.prepare`` and ``accelerator.skip_first_batches``."""
    dataset = identified_dataset()
    accelerator = Accelerator(cpu=True)
    prepared = accelerator.prepare(train_loader(dataset, batch_size=BATCH, seed=5, num_workers=0, pin_memory=False))
    ours = DeviceImageLoader.from_dataset(
        dataset, batch_size=BATCH, seed=5, device=accelerator.device, process_index=0, num_processes=1
    )
    assert len(ours) == len(prepared) == 9
    for epoch, skip in ((0, 0), (1, 4)):
        prepared.set_epoch(epoch)
        ours.set_epoch(epoch)
        reference = accelerator.skip_first_batches(prepared, skip) if skip else prepared
        assert_same_batches(list(ours.skip_first(skip) if skip else ours), list(reference))
        assert len(ours.skip_first(skip)) == len(prepared) - skip


def test_each_sample_once_per_epoch_across_processes_and_incomplete_batches_dropped():
    dataset = identified_dataset(75)
    seen = [
        int(label)
        for rank in (0, 1)
        for _, labels in device_batches(dataset, epoch=2, processes=2, rank=rank)
        for label in labels
    ]
    assert len(seen) == len(set(seen)) == 64  # 9 global batches of 8: the 9th has no partner batch, so dropped
    assert (
        len(
            DeviceImageLoader.from_dataset(
                dataset, batch_size=BATCH, seed=0, device="cpu", process_index=1, num_processes=2
            )
        )
        == 4
    )


def test_consecutive_global_batches_go_to_consecutive_ranks():
    """One optimizer micro-step covers consecutive samples of the global order: 2 ranks at b = 1 rank at 2b."""
    dataset = identified_dataset(64)
    rank_batches = [device_batches(dataset, epoch=0, processes=2, rank=rank) for rank in (0, 1)]
    one_process = DeviceImageLoader.from_dataset(
        dataset, batch_size=2 * BATCH, seed=5, device="cpu", process_index=0, num_processes=1
    )
    for step, (_, labels) in enumerate(one_process):
        assert torch.equal(labels, torch.cat([rank_batches[0][step][1], rank_batches[1][step][1]]))


def test_epochs_differ_and_the_seed_decides():
    dataset = identified_dataset()

    def epoch_of(**options) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = zip(*device_batches(dataset, **options), strict=True)
        return torch.cat(images), torch.cat(labels)

    assert all(map(torch.equal, epoch_of(epoch=1, seed=5), epoch_of(epoch=1, seed=5)))
    order = epoch_of(epoch=1, seed=5)[1]
    assert not torch.equal(order, epoch_of(epoch=2, seed=5)[1]) and not torch.equal(order, epoch_of(epoch=1, seed=6)[1])
    # a full pass moves to the next epoch, as Accelerate's DataLoaderShard does
    loader = DeviceImageLoader.from_dataset(
        dataset, batch_size=BATCH, seed=5, device="cpu", process_index=0, num_processes=1
    )
    first, second = [torch.cat([labels for _, labels in loader]) for _ in range(2)]
    assert torch.equal(second, order) and not torch.equal(first, second)


def test_no_augment_means_plain_normalised_images():
    dataset = identified_dataset()
    dataset.augment = None
    for images, labels in device_batches(dataset, epoch=0):
        assert torch.equal(images, torch.stack([dataset[int(i)][0] for i in labels]))


def test_gradient_accumulation_syncs_at_the_end_of_each_epoch_like_a_prepared_dataloader():
    """10 batches, accumulation 3: syncs after batches 3, 6, 9 and 10 (the epoch's end), for both loaders."""
    dataset = identified_dataset(80)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3)
    model, prepared = accelerator.prepare(
        nn.Linear(1, 1), train_loader(dataset, batch_size=BATCH, seed=5, num_workers=0, pin_memory=False)
    )
    ours = DeviceImageLoader.from_dataset(
        dataset, batch_size=BATCH, seed=5, device=accelerator.device, process_index=0, num_processes=1
    )

    def sync_pattern(batches) -> list[bool]:
        pattern = []
        for _ in batches:
            with accelerator.accumulate(model):
                pattern.append(accelerator.sync_gradients)
        return pattern

    expected = [False, False, True] * 3 + [True]
    for epoch in (0, 1):
        prepared.set_epoch(epoch)
        ours.set_epoch(epoch)
        assert sync_pattern(prepared) == sync_pattern(ours) == expected
        assert sum(expected) == 4 and not accelerator.gradient_state.in_dataloader
    ours.set_epoch(2)
    prepared.set_epoch(2)
    assert sync_pattern(ours.skip_first(4)) == sync_pattern(accelerator.skip_first_batches(prepared, 4))
    # stopping mid-epoch leaves no stale loader registered
    batches = iter(ours)
    next(batches)
    assert accelerator.gradient_state.in_dataloader
    batches.close()
    assert not accelerator.gradient_state.in_dataloader


def test_channels_last_batches_are_channels_last_with_the_same_values():
    dataset = identified_dataset()
    plain = device_batches(dataset, epoch=0)
    for (images, _), (expected, _) in zip(device_batches(dataset, epoch=0, channels_last=True), plain, strict=True):
        assert images.is_contiguous(memory_format=torch.channels_last) and torch.equal(images, expected)
    assert plain[0][0].is_contiguous()


def test_image_folder_is_decoded_once_cached_reused_and_invalidated(image_folder, tmp_path, monkeypatch):
    train, _ = image_datasets("imagefolder", str(image_folder), seed=0)
    cache_dir = tmp_path / "cache"

    def build() -> DeviceImageLoader:
        return DeviceImageLoader.from_dataset(
            train, batch_size=4, seed=0, device="cpu", process_index=0, num_processes=1, cache_dir=cache_dir
        )

    first = build()
    (cache_file,) = cache_dir.glob("*.safetensors")
    assert torch.equal(first.images, torch.stack([decode_image_file(path, 32) for path in train.images]))
    assert_same_batches(list(first), list(train_loader(train, batch_size=4, seed=0, num_workers=0, pin_memory=False)))

    written = cache_file.stat().st_mtime_ns
    with monkeypatch.context() as patch:  # a second build must not decode anything
        patch.setattr(device_loader, "decode_image_file", _must_not_decode)
        assert torch.equal(build().images, first.images)
    assert cache_file.stat().st_mtime_ns == written

    changed = train.images[5]
    Image.new("RGB", (40, 40), (255, 0, 0)).save(changed)
    os.utime(changed, ns=(written + 10**9, written + 10**9))
    rebuilt = build()
    assert cache_file.stat().st_mtime_ns != written and list(cache_dir.glob("*.safetensors")) == [cache_file]
    assert torch.equal(rebuilt.images[5], decode_image_file(changed, 32)) and not torch.equal(
        rebuilt.images[5], first.images[5]
    )


def _must_not_decode(path, image_size):
    raise AssertionError(f"decoded {path} although the cache is valid")


def test_a_dataset_without_a_device_loader_is_refused_in_one_line(tmp_path):
    """The loop asks the dataset for its device loader (acceltrain.vision.ImageClassification has one)."""
    from acceltrain import TrainConfig, fit

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 2))
    cfg = TrainConfig(
        data_on_device=True, batch_size=2, max_steps=1, report_to="none", output_dir=str(tmp_path / "run")
    )
    with pytest.raises(
        ConfigError, match="--data-on-device needs a dataset with a device_loader\\(\\) method"
    ) as error:
        fit(
            cfg,
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            TensorDataset(torch.zeros(4, 3, 8, 8), torch.zeros(4, dtype=torch.long)),
        )
    assert "\n" not in str(error.value) and "TensorDataset has none" in str(error.value)
    assert not (tmp_path / "run").exists()
