"""The speed flags: each runs end to end on a tiny model, and none changes what is learned."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import RECIPE, read_events, read_summary, reset_accelerate_state
from safetensors.torch import load_file

from acceltrain import run_recipe
from acceltrain.train.speed import enable_activation_checkpointing, training_flops_per_sample
from acceltrain.train.tasks import ClassificationTask

sys.path.insert(0, str(RECIPE.parent))
from resnet_cifar import CifarConfig  # noqa: E402
from resnet_cifar import main as cifar_main

TINY = [
    "--dataset",
    "synthetic",
    "--model",
    "resnet_tiny",
    "--batch-size",
    "16",
    "--max-steps",
    "6",
    "--lr",
    "0.05",
    "--no-progress",
    "--num-workers",
    "0",
    "--log-every",
    "2",
    "--timing-warmup-steps",
    "2",
]


def run_cifar(output_dir: Path, *args: str) -> dict:
    reset_accelerate_state()
    run_recipe(cifar_main, CifarConfig, [*TINY, "--output-dir", str(output_dir), *args])
    return read_summary(output_dir)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    out = tmp_path_factory.mktemp("plain")
    return out, run_cifar(out)


def test_activation_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    from acceltrain.vision import build_resnet

    reference = build_resnet("resnet_tiny")
    checkpointed = build_resnet("resnet_tiny")
    checkpointed.load_state_dict(reference.state_dict())
    assert "3 residual blocks" in enable_activation_checkpointing(checkpointed)
    inputs, labels = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    task = ClassificationTask()
    for model in (reference, checkpointed):
        task.train_loss(model, (inputs, labels)).backward()
    for (name, a), b in zip(reference.named_parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)
    for (name, a), b in zip(reference.named_buffers(), checkpointed.buffers(), strict=True):
        assert torch.equal(a, b), f"{name}: recomputation must not update BatchNorm statistics twice"


@pytest.mark.slow
def test_activation_checkpointing_run_matches_the_plain_run(tmp_path, plain):
    summary = run_cifar(tmp_path / "ac", "--activation-checkpointing")
    plain_weights, ac_weights = (
        load_file(str(plain[0] / "model.safetensors")),
        load_file(str(tmp_path / "ac" / "model.safetensors")),
    )
    for key in plain_weights:
        torch.testing.assert_close(ac_weights[key], plain_weights[key], rtol=1e-4, atol=1e-6)
    assert summary["steps"] == 6


@pytest.mark.slow
def test_flops_are_counted_before_activation_checkpointing(tmp_path, plain):
    """Before: counted after it, so MFU included the recomputed forward (1.33x on ResNet-18)."""
    summary = run_cifar(tmp_path / "ac", "--activation-checkpointing", "--max-steps", "2")
    assert summary["runtime"]["model_flops_per_sample"] == plain[1]["runtime"]["model_flops_per_sample"]


@pytest.mark.slow
def test_channels_last_and_bf16_run_end_to_end(tmp_path, plain):
    summary = run_cifar(tmp_path / "cl", "--channels-last", "--mixed-precision", "bf16")
    assert summary["mixed_precision"] == "bf16" and summary["config"]["channels_last"]
    assert abs(summary["train_loss"] - plain[1]["train_loss"]) < 0.5


def test_activation_checkpointing_on_a_model_without_blocks_is_a_one_line_error():
    from acceltrain import ConfigError

    with pytest.raises(ConfigError, match="has no residual blocks"):
        enable_activation_checkpointing(torch.nn.Linear(2, 2))


def test_speed_figures_are_logged_and_summarised(plain):
    out, summary = plain
    assert summary["timed_steps"] == 4 and summary["ms_per_step"] > 0
    assert 0 <= summary["data_wait_fraction"] <= 1 and summary["peak_rss_mb"] > 0
    runtime = summary["runtime"]
    assert runtime["model_flops_per_sample"] > 0 and runtime["peak_flops_datasheet"] is None  # a CPU: no datasheet
    # issue 46: MFU on a CPU too, against the peak measured for the run's dtype and model
    assert runtime["peak_flops_measured"] > 0 and runtime["peak_flops_per_device"] == runtime["peak_flops_measured"]
    rows, inputs, outputs = runtime["peak_flops_shape"]  # the calibrated matmul: the model's largest dense layer
    assert rows == 2048 and min(inputs, outputs) >= 256
    assert summary["mfu"] == pytest.approx(summary["model_tflops_per_second"] * 1e12 / runtime["peak_flops_measured"])
    assert "mfu_datasheet" not in summary
    logged = [e for e in read_events(out) if "loss" in e]
    assert logged[0]["samples_per_second"] is None  # inside the timing warm-up
    assert all(e["ms_per_step"] > 0 and "peak_rss_mb" in e for e in logged[1:])


@pytest.mark.slow
def test_mfu_uses_the_given_peak(tmp_path):
    summary = run_cifar(tmp_path / "mfu", "--peak-tflops", "1.0")
    assert summary["mfu"] == pytest.approx(summary["model_tflops_per_second"] / 1.0)


@pytest.mark.parametrize("given", [None, "1e-9"], ids=["measured", "peak-tflops"])
def test_no_mfu_above_1_a_peak_below_what_the_run_reached_is_said_and_leaves_the_cache(tmp_path, monkeypatch, given):
    """A peak calibrated while the machine was busy stayed in the cache, and a later run printed MFU 1.58
    (benchmarks/packing.py). Now: no MFU, one line naming both figures, and a measured peak leaves the cache."""
    import json
    import logging

    from acceltrain.runtime import peak

    monkeypatch.setenv("ACCELTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(peak, "_calibrate", lambda *_: 1e3)  # 1,000 FLOP/s: any run is faster
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("acceltrain").addHandler(handler)
    try:
        summary = run_cifar(tmp_path / "run", *(["--peak-tflops", given] if given else []))
    finally:
        logging.getLogger("acceltrain").removeHandler(handler)
    assert summary["model_tflops_per_second"] > 0 and summary["mfu"] is None
    assert all(row["mfu"] is None for row in read_events(tmp_path / "run") if "mfu" in row)
    said = [line for line in lines if "mfu: this run reached" in line]
    assert len(said) == 1, lines
    assert ("--peak-tflops 1e-09" if given else "measured peak") in said[0]
    cached = json.loads((tmp_path / "cache" / peak.CACHE_FILE).read_text())
    assert list(cached.values()) == ([1e3] if given else [])  # a given peak was the wrong one: the cache stays


def test_flops_are_counted_without_touching_the_model():
    from acceltrain.vision import build_resnet

    model = build_resnet("resnet_tiny")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flops = training_flops_per_sample(model, ClassificationTask(), (torch.randn(2, 3, 32, 32), torch.tensor([0, 1])))
    linear_flops = 2 * 64 * 10 * 3  # the head alone: forward + two backward matmuls
    assert flops > linear_flops
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_flops_are_counted_for_a_batch_a_collator_makes():
    """A Transformers collator's batch is a BatchEncoding (a UserDict, not a dict): it was not counted (MFU None)."""
    from collections import UserDict

    class RowsTask(ClassificationTask):
        def train_loss(self, model, batch):
            return super().train_loss(model, (batch["x"], batch["label"]))

    model = torch.nn.Linear(4, 3)
    flops = training_flops_per_sample(
        model, RowsTask(), UserDict({"x": torch.randn(2, 4), "label": torch.tensor([0, 1])})
    )
    assert flops == 2 * 2 * 4 * 3  # forward and the weight gradient's matmul of one sample (the input needs none)


class OutOfMemoryAbove16(torch.nn.Module):
    """Behaves like a GPU that cannot hold more than 16 samples."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 10))

    def forward(self, x):
        if len(x) > 16:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return self.net(x)


@pytest.mark.slow
@pytest.mark.parametrize("keep,scale", [(True, "none"), (False, "linear")])
def test_auto_batch_size_recovers_from_out_of_memory(tmp_path, monkeypatch, capsys, keep, scale):
    import acceltrain.vision

    monkeypatch.setattr(
        acceltrain.vision, "build_model", lambda *a, **k: OutOfMemoryAbove16()
    )  # the recipe imports it in main()
    extra = ["--keep-effective-batch" if keep else "--no-keep-effective-batch", "--scale-lr", scale]
    summary = run_cifar(
        tmp_path / "auto", "--auto-batch-size", "--batch-size", "64", "--grad-accum", "1", "--lr", "0.4", *extra
    )
    cfg = summary["config"]
    assert cfg["batch_size"] == 16
    if keep:
        assert (cfg["grad_accum"], cfg["lr"]) == (4, 0.4) and summary["samples_seen"] == 6 * 64
    else:
        assert (cfg["grad_accum"], cfg["lr"]) == (1, pytest.approx(0.1)) and summary["samples_seen"] == 6 * 16
    assert "--auto-batch-size: batch 64 does not fit, using 16" in capsys.readouterr().out


@pytest.mark.slow
def test_compile_on_a_tiny_model_saves_plain_keys_and_reports_compile_time(tmp_path):
    out = tmp_path / "compiled"
    summary = run_cifar(out, "--compile", "--max-steps", "4", "--save-every-steps", "2")
    assert summary["compile_seconds"] is not None and summary["compile_seconds"] > 0
    from acceltrain.vision import build_resnet

    plain_keys = set(build_resnet("resnet_tiny").state_dict())
    assert set(load_file(str(out / "model.safetensors"))) == plain_keys
    (checkpoint,) = (out / "checkpoints").glob("step_00000004")
    assert set(load_file(str(checkpoint / "model.safetensors"))) == plain_keys


def test_data_on_device_trains_exactly_like_the_dataloader_path(tmp_path, plain):
    summary = run_cifar(tmp_path / "device", "--data-on-device")
    assert (tmp_path / "device" / "model.safetensors").read_bytes() == (plain[0] / "model.safetensors").read_bytes()
    assert summary["train_loss"] == plain[1]["train_loss"]


def test_data_on_device_on_an_image_folder_caches_the_decoded_images_in_acceltrain_cache(
    tmp_path, image_folder, monkeypatch
):
    monkeypatch.setenv("ACCELTRAIN_CACHE", str(tmp_path / "cache"))
    run_cifar(
        tmp_path / "run",
        "--dataset",
        "imagefolder",
        "--data-dir",
        str(image_folder),
        "--batch-size",
        "6",
        "--max-steps",
        "3",
        "--data-on-device",
    )
    assert len(list((tmp_path / "cache").glob("decoded-*.safetensors"))) == 2  # train and test split, each decoded once
    assert not list(image_folder.rglob("*.safetensors")), "nothing written into the data folder"
