"""Data order, sharding and augmentation: deterministic from the seed, independent of who loads what."""

from __future__ import annotations

import pytest
import torch
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler

from acceltrain.data.loaders import EpochSampler, train_loader
from acceltrain.vision import CropFlip, ImageClassification, image_datasets, synthetic_images


def test_shuffle_is_seeded_and_differs_between_epochs():
    sampler = EpochSampler(100, seed=3)
    first, second = sampler.order(0), sampler.order(1)
    assert sorted(first) == list(range(100)) and first != second
    assert first == EpochSampler(100, seed=3).order(0)
    assert first != EpochSampler(100, seed=4).order(0)
    sampler.set_epoch(1)
    assert [index for _, index in sampler] == second
    assert {epoch for epoch, _ in sampler} == {1}


def test_rank_shards_are_disjoint_cover_the_data_and_match_one_big_batch():
    """Accelerate's BatchSamplerShard over our global order: 2 ranks at batch b = 1 rank at batch 2b."""
    sampler = EpochSampler(64, seed=0)
    shards = []
    for rank in range(2):
        batches = BatchSamplerShard(BatchSampler(sampler, 8, drop_last=True), num_processes=2, process_index=rank)
        shards.append([[index for _, index in batch] for batch in batches])
    flat = [set(sum(shard, [])) for shard in shards]
    assert not flat[0] & flat[1] and flat[0] | flat[1] == set(range(64))
    big_batches = [[index for _, index in batch] for batch in BatchSampler(sampler, 16, drop_last=True)]
    for step, big in enumerate(big_batches):
        assert big == shards[0][step] + shards[1][step]


def test_augmentation_depends_only_on_seed_epoch_and_index():
    (images, labels), _ = synthetic_images(16, 1, seed=0)
    dataset = ImageClassification(images, labels, [str(i) for i in range(10)], augment=CropFlip(), seed=7)
    forward = [dataset.sample(i, epoch=2)[0] for i in range(16)]
    backward = [dataset.sample(i, epoch=2)[0] for i in reversed(range(16))][::-1]
    assert all(torch.equal(a, b) for a, b in zip(forward, backward, strict=True))
    other_epoch = [dataset.sample(i, epoch=3)[0] for i in range(16)]
    assert not all(torch.equal(a, b) for a, b in zip(forward, other_epoch, strict=True))
    plain = dataset[0][0]
    assert plain.shape == forward[0].shape == (3, 32, 32) and plain.dtype == torch.float32


def test_crop_flip_matches_a_plain_pad_crop_flip():
    image = torch.arange(3 * 8 * 8, dtype=torch.uint8).view(3, 8, 8)
    augment = CropFlip(padding=2)
    padded = torch.nn.functional.pad(image, (2, 2, 2, 2))
    seen = set()
    for index in range(40):
        (top,), (left,), (flip,) = (t.tolist() for t in augment.draws(3, 1, torch.tensor([index])))
        expected = padded[:, top : top + 8, left : left + 8]
        expected = expected.flip(-1) if flip else expected
        assert torch.equal(augment(image, 3, 1, index), expected)
        seen.add((top, left, flip))
    assert len(seen) > 20  # the draws vary


def test_crop_flip_on_a_batch_equals_per_sample():
    (images, _), _ = synthetic_images(16, 1, seed=0)
    augment = CropFlip()
    indices = torch.arange(100, 116)
    batch = augment.apply(images, *augment.draws(5, 2, indices))
    assert all(torch.equal(batch[i], augment(images[i], 5, 2, 100 + i)) for i in range(16))


def test_loader_with_workers_gives_the_same_batches_as_without():
    (images, labels), _ = synthetic_images(40, 1, seed=0)
    dataset = ImageClassification(images, labels, [str(i) for i in range(10)], augment=CropFlip(), seed=1)
    batches = []
    for workers in (0, 2):
        loader = train_loader(dataset, batch_size=8, seed=5, num_workers=workers, pin_memory=False)
        loader.sampler.set_epoch(1)
        batches.append([images for images, _ in loader])
    assert len(batches[0]) == 5
    assert all(torch.equal(a, b) for a, b in zip(*batches, strict=True))


def test_image_folder_datasets_decode_and_resize(image_folder):
    train, evaluation = image_datasets("imagefolder", str(image_folder), seed=0)
    assert (len(train), len(evaluation), train.classes) == (36, 12, ["cat", "dog", "frog"])
    image, label = train.sample(0, epoch=0)
    assert image.shape == (3, 32, 32) and int(label) == 0
    assert int(evaluation[11][1]) == 2


def test_synthetic_data_is_deterministic_and_class_dependent():
    (a, la), _ = synthetic_images(200, 1, seed=0)
    (b, lb), _ = synthetic_images(200, 1, seed=0)
    assert torch.equal(a, b) and torch.equal(la, lb)
    means = torch.stack([a[la == c].float().mean(dim=(0, 2, 3)) for c in range(10)])
    assert means.std(dim=0).min() > 5  # the classes differ in colour


@pytest.mark.slow
def test_the_process_exits_at_once_when_the_run_outlives_fit_with_persistent_workers(tmp_path):
    """Workers ignore SIGTERM (a preemption is the main process's to handle), so multiprocessing's exit
    handler, which terminates them with SIGTERM and then waits, waited minutes for the workers of a loader
    still referenced at exit (here: a hook keeps the run). fit() now stops its workers itself."""
    import subprocess
    import sys

    from conftest import REPO, TINY_RECIPE, subprocess_env

    script = tmp_path / "keeps_the_run.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(TINY_RECIPE.parent)!r})\n"
        "import tiny_recipe\n"
        "from acceltrain import Hook, run_recipe\n"
        "kept = []\n"
        "class KeepRun(Hook):\n"
        "    def on_fit_start(self, run):\n"
        "        kept.append(run)\n"
        "run_recipe(lambda cfg: tiny_recipe.main(cfg, hooks=[KeepRun()]), tiny_recipe.TinyConfig)\n"
    )
    done = subprocess.run(
        [
            sys.executable,
            str(script),
            "--batch-size",
            "8",
            "--max-steps",
            "3",
            "--num-workers",
            "1",
            "--no-progress",
            "--report-to",
            "none",
            "--output-dir",
            str(tmp_path / "out"),
        ],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
