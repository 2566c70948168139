"""airbench's time-to-accuracy techniques as toolkit pieces: test-time augmentation, alternating flips and
reflect-padded crops keyed on (seed, epoch, index), whitening initialisation of a first conv, the fast CIFAR
net and its preset."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from accelerate.data_loader import BatchSamplerShard
from conftest import RECIPE, REPO, check, launch, read_summary
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader

from acceltrain import ClassificationTask, ConfigError, parse_config
from acceltrain.data.loaders import train_loader
from acceltrain.vision import (
    CropFlip,
    DeviceImageLoader,
    FastCifarNet,
    ImageClassification,
    build_model,
    synthetic_images,
    whiten_first_conv,
    whitening_images,
)
from acceltrain.vision.whitening import patch_moments

sys.path.insert(0, str(RECIPE.parent))
from resnet_cifar import CifarConfig  # noqa: E402

PRESET = REPO / "recipes" / "configs" / "cifar10_fast.yaml"


def tiny_classifier() -> nn.Module:
    """Neither flip- nor shift-invariant (the linear head sees every position), with BatchNorm in eval mode."""
    torch.manual_seed(0)
    return (
        nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
        .double()
        .eval()
    )


def reflect_shift(images: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """``images`` moved by (rows, columns) pixels, the pixels brought in mirrored about the edge, by plain indexing."""
    height, width = images.shape[-2:]

    def mirrored(positions, size):
        positions = positions.abs()
        return torch.where(positions > size - 1, 2 * (size - 1) - positions, positions)

    return images[..., mirrored(torch.arange(height) - rows, height), :][
        ..., mirrored(torch.arange(width) - columns, width)
    ]


# --------------------------------------------------------------------------- test-time augmentation


def test_tta_averages_the_logits_of_the_views_as_computed_by_hand():
    model, images, labels = tiny_classifier(), torch.randn(7, 3, 8, 8, dtype=torch.float64), torch.arange(7) % 5
    with torch.no_grad():
        plain, mirror = model(images), model(images.flip(-1))
        down_right, up_left = reflect_shift(images, 1, 1), reflect_shift(images, -1, -1)
        shifted = [model(down_right), model(down_right.flip(-1)), model(up_left), model(up_left.flip(-1))]
        expected = {
            "none": plain,
            "flip": (plain + mirror) / 2,
            "flip-translate": (plain + mirror) / 4 + sum(shifted) / 8,
        }
        for mode, logits in expected.items():
            task = ClassificationTask(tta=mode)
            torch.testing.assert_close(task.eval_logits(model, images), logits, rtol=1e-12, atol=1e-12)
            values = task.eval_values(model, (images, labels))
            torch.testing.assert_close(values["loss"], F.cross_entropy(logits.float(), labels, reduction="none"))
            assert torch.equal(values["accuracy"], (logits.argmax(-1) == labels).float())
    assert not torch.allclose(expected["flip"], expected["flip-translate"]), (
        "the shifts must matter for this test to mean anything"
    )


def test_an_unknown_tta_mode_is_one_line():
    with pytest.raises(ConfigError, match="tta 'mirror' is invalid: choose one of none, flip, flip-translate"):
        ClassificationTask(tta="mirror")


# --------------------------------------------------------------------------- alternating flip, reflect padding


def test_alternating_flip_is_epoch_zeros_random_flip_inverted_on_odd_epochs():
    indices = torch.arange(1000)
    random, alternating = CropFlip(padding=2), CropFlip(padding=2, flip="alternating")
    first = random.draws(3, 0, indices)[2]
    assert 400 < first.sum() < 600
    for epoch in range(5):
        top, left, flip = alternating.draws(3, epoch, indices)
        random_top, random_left, _ = random.draws(3, epoch, indices)
        assert torch.equal(top, random_top) and torch.equal(left, random_left), (
            "the crops do not depend on the flip mode"
        )
        assert torch.equal(flip, first ^ (epoch % 2))
    assert not CropFlip(flip="none").draws(3, 1, indices)[2].any()


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect"])
@pytest.mark.parametrize("flip", ["alternating", "random"])
def test_one_image_and_a_batch_are_augmented_identically(flip, padding_mode):
    (images, _), _ = synthetic_images(24, 1, seed=0)
    augment = CropFlip(padding=3, flip=flip, padding_mode=padding_mode)
    indices = torch.arange(24)
    for epoch in (0, 1, 2):
        batch = augment.apply(images, *augment.draws(9, epoch, indices))
        assert torch.equal(batch, torch.stack([augment(images[i], 9, epoch, i) for i in range(24)]))


def test_reflect_padding_brings_in_the_mirrored_image():
    image = torch.arange(2 * 5 * 5, dtype=torch.uint8).view(1, 2, 5, 5)
    augment = CropFlip(padding=2, flip="none", padding_mode="reflect")
    top, left, flip = torch.tensor([0]), torch.tensor([4]), torch.tensor([0])  # 2 rows down, 2 columns left
    assert torch.equal(augment.apply(image, top, left, flip), reflect_shift(image, 2, -2))


def test_bad_augmentation_settings_are_one_line():
    with pytest.raises(ConfigError, match="flip 'sometimes' is invalid: choose one of random, alternating, none"):
        CropFlip(flip="sometimes")
    with pytest.raises(
        ConfigError, match="crop padding 32 is invalid for reflect padding of 32x32 images: must be < 32"
    ):
        CropFlip(padding=32, padding_mode="reflect").check_image_size(32, 32)


def test_device_loader_gives_the_alternating_reflect_batches_of_the_dataloader_on_each_rank():
    """The on-device loader (one process or each of two) against the DataLoader sharded as Accelerate shards it."""
    (images, _), _ = synthetic_images(40, 1, seed=0)
    augment = CropFlip(padding=2, flip="alternating", padding_mode="reflect")
    dataset = ImageClassification(images, torch.arange(40), [str(i) for i in range(40)], augment=augment, seed=4)
    for processes, rank in ((1, 0), (2, 0), (2, 1)):
        loader = DeviceImageLoader.from_dataset(
            dataset, batch_size=4, seed=6, device="cpu", process_index=rank, num_processes=processes
        )
        reference = train_loader(dataset, batch_size=4, seed=6, num_workers=0, pin_memory=False)
        for epoch in (0, 1, 2):
            loader.set_epoch(epoch)
            reference.sampler.set_epoch(epoch)
            shard = BatchSamplerShard(reference.batch_sampler, num_processes=processes, process_index=rank)
            expected = list(DataLoader(reference.dataset, batch_sampler=shard))
            ours = list(loader)
            assert len(ours) == len(expected) == 10 // processes
            for (x, y), (x_ref, y_ref) in zip(ours, expected, strict=True):
                assert torch.equal(x, x_ref) and torch.equal(y, y_ref)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_alternating_flip_whitening_and_tta_train_the_same_on_one_and_two_processes(tmp_path, image_folder):
    """Two gloo processes at batch b (on-device loader) against one at 2b (DataLoader): the same samples, the same
    flips on every epoch, the same whitened first conv, the same TTA evaluation. Two steps an epoch: over many
    steps float rounding grows past what a wrong flip shows (random instead of alternating flips: 5e-4 here)."""
    common = [  # the tiny ImageFolder tree: 36 training images, 12 to evaluate
        "--dataset",
        "imagefolder",
        "--data-dir",
        str(image_folder),
        "--model",
        "resnet_tiny",
        "--epochs",
        "2",
        "--lr",
        "0.05",
        "--sync-bn",
        "--flip",
        "alternating",
        "--crop-padding",
        "2",
        "--crop-padding-mode",
        "reflect",
        "--whiten-first-conv",
        "--tta",
        "flip-translate",
        "--num-workers",
        "0",
        "--no-progress",
        "--report-to",
        "none",
    ]
    check(
        launch(
            RECIPE,
            [*common, "--batch-size", "9", "--data-on-device", "--output-dir", str(tmp_path / "ddp")],
            processes=2,
            launcher="accelerate",
        )
    )
    check(launch(RECIPE, [*common, "--batch-size", "18", "--output-dir", str(tmp_path / "single")]))
    ddp, single = read_summary(tmp_path / "ddp"), read_summary(tmp_path / "single")
    assert (ddp["num_processes"], single["num_processes"]) == (2, 1)
    assert ddp["samples_seen"] == single["samples_seen"] == 2 * 36
    ddp_weights, single_weights = (load_file(str(tmp_path / run / "model.safetensors")) for run in ("ddp", "single"))
    for key in single_weights:
        # rounding on the tiny tree: 6e-7 on an AMD EPYC (gloo's sum order); a wrong flip: 5e-4 (measured 2026-12-05)
        torch.testing.assert_close(ddp_weights[key].float(), single_weights[key].float(), rtol=1e-4, atol=5e-5)
    assert ddp["eval_accuracy"] == pytest.approx(single["eval_accuracy"], abs=1 / 12)


# --------------------------------------------------------------------------- whitening initialisation


def correlated_images(count: int = 64) -> torch.Tensor:
    """Smooth colour images (noise upsampled 4x, channels mixed):
    neighbouring pixels and channels strongly correlated."""
    generator = torch.Generator().manual_seed(1)
    coarse = torch.randn(count, 3, 8, 8, generator=generator)
    mixing = torch.tensor([[1.0, 0.8, 0.6], [0.0, 0.6, 0.5], [0.0, 0.0, 0.4]])
    return F.interpolate(torch.einsum("ij,njhw->nihw", mixing, coarse), scale_factor=4, mode="bilinear") + 0.3


@pytest.mark.parametrize("kernel,out_channels", [(2, 24), (3, 16)])
def test_whitened_patches_have_identity_covariance(kernel, out_channels):
    images = correlated_images()
    conv = nn.Conv2d(3, out_channels, kernel, bias=True)
    _, before = patch_moments(images, (kernel, kernel))
    assert before.diagonal().min() / torch.linalg.eigvalsh(before).min() > 100, "the input patches are far from white"
    whiten_first_conv(nn.Sequential(conv, nn.GELU()), images, eps=1e-8)
    with torch.no_grad():
        outputs = conv(images).double().permute(0, 2, 3, 1).reshape(-1, out_channels)
    half = out_channels // 2
    torch.testing.assert_close(outputs.mean(0), torch.zeros(out_channels, dtype=torch.float64), atol=1e-4, rtol=0)
    covariance = outputs[:, :half].T @ outputs[:, :half] / len(outputs)
    torch.testing.assert_close(covariance, torch.eye(half, dtype=torch.float64), atol=2e-3, rtol=0)
    torch.testing.assert_close(outputs[:, half:], -outputs[:, :half], atol=1e-4, rtol=0)
    assert not conv.weight.requires_grad and conv.bias.requires_grad


def test_a_first_conv_too_wide_to_whiten_is_one_line():
    with pytest.raises(
        ConfigError, match="ResNet's first conv: whitening needs .* at most 2 x 3x3x3 = 54; this one is 3->64 channels"
    ):
        whiten_first_conv(build_model("resnet18"), correlated_images(4))


def test_whitening_images_are_a_seeded_subset_through_the_datasets_own_loading():
    (images, labels), _ = synthetic_images(50, 1, seed=0)
    dataset = ImageClassification(images, labels, [str(i) for i in range(10)], augment=CropFlip(), seed=0)
    chosen = whitening_images(dataset, 20, seed=5)
    assert torch.equal(chosen, whitening_images(dataset, 20, seed=5)) and not torch.equal(
        chosen, whitening_images(dataset, 20, seed=6)
    )
    everything = torch.stack([dataset[i][0] for i in range(50)])
    assert all((everything == image).flatten(1).all(1).any() for image in chosen)
    assert len(whitening_images(dataset, 500, seed=5)) == 50


# --------------------------------------------------------------------------- the fast net and its preset


def test_fast_net_has_airbenchs_shape_and_frozen_batchnorm_scales():
    model = build_model("fast_cifar", num_classes=7)
    assert isinstance(model, FastCifarNet) and model.whiten.weight.shape == (24, 3, 2, 2)
    assert 1.9e6 < sum(p.numel() for p in model.parameters()) < 2.0e6
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert all(not m.weight.requires_grad and m.bias.requires_grad and m.eps == 1e-12 for m in norms)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)
    with pytest.raises(ConfigError, match="--stem 'imagenet' is invalid for --model fast_cifar"):
        build_model("fast_cifar", stem="imagenet")


def test_the_fast_preset_parses_and_says_what_it_means():
    cfg = parse_config(CifarConfig, ["--config", str(PRESET)])
    assert (cfg.model, cfg.dataset, cfg.flip, cfg.tta, cfg.label_smoothing) == (
        "fast_cifar",
        "cifar10",
        "alternating",
        "flip-translate",
        0.2,
    )
    assert cfg.whiten_first_conv and cfg.data_on_device and cfg.channels_last and cfg.epochs <= 12


@pytest.mark.slow
def test_the_fast_preset_trains_a_few_steps_on_synthetic_data(tmp_path):
    """The preset end to end on CPU (smaller batch, fp32, two steps); tracking off."""
    out = tmp_path / "fast"
    check(
        launch(
            RECIPE,
            [
                "--config",
                str(PRESET),
                "--dataset",
                "synthetic",
                "--batch-size",
                "32",
                "--max-steps",
                "2",
                "--mixed-precision",
                "no",
                "--no-progress",
                "--report-to",
                "none",
                "--output-dir",
                str(out),
            ],
        )
    )
    summary = read_summary(out)
    assert summary["steps"] == 2 and 0 <= summary["eval_accuracy"] <= 1
