"""The loop on one process: accumulation maths, step counts, the LR schedule, exact evaluation, outputs."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import RECIPE, read_events, read_summary
from safetensors.torch import load_file

from acceltrain import run_recipe
from acceltrain.runtime.metrics import Throughput
from acceltrain.train.optim import lr_multiplier
from acceltrain.vision import CropFlip, ImageClassification, synthetic_images

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
sys.path.insert(0, str(RECIPE.parent))
import tiny_recipe  # noqa: E402
from resnet_cifar import CifarConfig  # noqa: E402
from resnet_cifar import main as cifar_main


def run_tiny(output_dir: Path, *args: str) -> tuple[dict, dict, dict]:
    argv = ["--output-dir", str(output_dir), "--no-progress", "--log-every", "1", "--weight-decay", "0", *args]
    run_recipe(tiny_recipe.main, tiny_recipe.TinyConfig, argv)
    counts = json.loads((output_dir / "rank0.json").read_text())
    return read_summary(output_dir), counts, load_file(str(output_dir / "rank0.safetensors"))


@pytest.mark.slow
def test_accumulating_k_micro_batches_equals_one_k_times_batch(tmp_path):
    common = ["--num-train", "128", "--max-steps", "4", "--lr", "0.2", "--lr-schedule", "cosine", "--warmup-steps", "1"]
    _, _, accumulated = run_tiny(tmp_path / "accum", *common, "--batch-size", "8", "--grad-accum", "4")
    _, _, big = run_tiny(tmp_path / "big", *common, "--batch-size", "32")
    for key in big:
        torch.testing.assert_close(accumulated[key], big[key], rtol=1e-5, atol=1e-6)


def test_summed_loss_is_normalised_by_the_window_target_count(tmp_path):
    """A (loss sum, target count) task: 4 micro-batches with different target counts give the big batch's
    gradient, not the mean of per-micro-batch means."""
    common = ["--num-train", "128", "--max-steps", "3", "--lr", "0.2", "--masked-loss", "--lr-schedule", "constant"]
    _, _, accumulated = run_tiny(tmp_path / "accum", *common, "--batch-size", "8", "--grad-accum", "4")
    _, _, big = run_tiny(tmp_path / "big", *common, "--batch-size", "32")
    for key in big:  # rounding of the two sums' orders: up to 4e-6 on one thread; the mean of means is off by 2e-2
        torch.testing.assert_close(accumulated[key], big[key], rtol=1e-5, atol=1e-5)


def test_partial_last_window_applies_the_mean_gradient_of_its_samples(tmp_path):
    """40 samples, batch 4, accumulate 3: windows of 3, 3, 3 and 1 micro-batches, 4 optimizer steps."""
    torch.manual_seed(0)
    reference_model = tiny_recipe.build_net(batchnorm=False)
    initial = copy.deepcopy(reference_model.state_dict())
    summary, counts, weights = run_tiny(
        tmp_path / "run",
        "--num-train",
        "40",
        "--batch-size",
        "4",
        "--grad-accum",
        "3",
        "--epochs",
        "1",
        "--lr",
        "0.1",
        "--lr-schedule",
        "constant",
        "--momentum",
        "0.9",
        "--seed",
        "0",
    )
    assert summary["steps"] == counts["steps"] == 4 and summary["samples_seen"] == 40

    (images, labels), _ = synthetic_images(40, 37, seed=0)
    dataset = ImageClassification(images, labels, [str(i) for i in range(10)], augment=CropFlip(), seed=0)
    from acceltrain.data.loaders import EpochSampler

    order = EpochSampler(40, seed=0).order(0)
    reference_model.load_state_dict(initial)
    optimizer = torch.optim.SGD(reference_model.parameters(), lr=0.1, momentum=0.9, nesterov=False)
    for start in (0, 12, 24, 36):
        window = order[start : min(start + 12, 40)]
        inputs = torch.stack([dataset.sample(i, 0)[0] for i in window])
        targets = torch.stack([dataset.sample(i, 0)[1] for i in window])
        optimizer.zero_grad()
        F.cross_entropy(reference_model(inputs), targets).backward()
        optimizer.step()
    for key, value in reference_model.state_dict().items():
        torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("grad_accum", [1, 3])
def test_one_optimizer_step_one_zero_grad_one_scheduler_step(tmp_path, grad_accum):
    summary, counts, _ = run_tiny(
        tmp_path / "run",
        "--num-train",
        "40",
        "--batch-size",
        "4",
        "--grad-accum",
        str(grad_accum),
        "--epochs",
        "2",
        "--lr",
        "0.1",
        "--warmup-steps",
        "2",
        "--lr-schedule",
        "cosine",
    )
    steps_per_epoch = -(-10 // grad_accum)
    total = 2 * steps_per_epoch
    assert summary["steps"] == counts["steps"] == counts["zero_grads"] == total
    expected = [0.1 * lr_multiplier(i, total_steps=total, warmup_steps=2, schedule="cosine") for i in range(total)]
    assert counts["lrs"] == pytest.approx(expected)
    logged = [e["lr"] for e in read_events(tmp_path / "run") if "loss" in e]
    assert logged == pytest.approx(expected)


def test_evaluation_covers_every_sample_exactly_once(tmp_path):
    summary, _, weights = run_tiny(tmp_path / "run", "--num-eval", "37", "--batch-size", "8", "--max-steps", "3")
    events = read_events(tmp_path / "run")
    assert [e["eval_samples"] for e in events if "eval_samples" in e] == [37]
    model = tiny_recipe.build_net(batchnorm=False)
    model.load_state_dict(weights)
    _, (images, labels) = synthetic_images(96, 37, seed=0)
    eval_set = ImageClassification(images, labels, [str(i) for i in range(10)])
    with torch.no_grad():
        inputs = torch.stack([eval_set[i][0] for i in range(37)])
        accuracy = (model(inputs).argmax(-1) == labels).float().mean().item()
    assert summary["eval_accuracy"] == pytest.approx(accuracy)


@pytest.mark.slow
def test_recipe_on_synthetic_data_learns_and_writes_its_outputs(tmp_path):
    out = tmp_path / "run"
    run_recipe(
        cifar_main,
        CifarConfig,
        [
            "--dataset",
            "synthetic",
            "--model",
            "resnet_tiny",
            "--batch-size",
            "32",
            "--max-steps",
            "24",
            "--lr",
            "0.05",
            "--log-every",
            "4",
            "--output-dir",
            str(out),
            "--no-progress",
        ],
    )
    summary = read_summary(out)
    for key in (
        "steps",
        "samples_seen",
        "epochs",
        "train_loss",
        "eval_accuracy",
        "samples_per_second",
        "wall_seconds",
        "num_processes",
        "mixed_precision",
        "config",
    ):
        assert key in summary
    assert summary["steps"] == 24 and summary["samples_seen"] == 24 * 32 and summary["num_processes"] == 1
    assert summary["samples_per_second"] > 0 and summary["timed_steps"] == 24 - 5
    losses = [e["loss"] for e in read_events(out) if "loss" in e]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert summary["eval_accuracy"] > 0.3  # 10 classes: chance is 0.1
    from acceltrain.vision import build_resnet

    plain_keys = set(build_resnet("resnet_tiny").state_dict())
    assert set(load_file(str(out / "model.safetensors"))) == plain_keys


@pytest.mark.slow
def test_recipe_on_an_image_folder(tmp_path, image_folder):
    out = tmp_path / "run"
    run_recipe(
        cifar_main,
        CifarConfig,
        [
            "--dataset",
            "imagefolder",
            "--data-dir",
            str(image_folder),
            "--model",
            "resnet_tiny",
            "--batch-size",
            "6",
            "--epochs",
            "2",
            "--output-dir",
            str(out),
            "--no-progress",
            "--num-workers",
            "1",
        ],
    )
    summary = read_summary(out)
    assert summary["steps"] == 12 and summary["epochs"] == 2.0
    assert summary["eval_accuracy"] is not None
    weights = load_file(str(out / "model.safetensors"))
    assert weights["head.2.weight"].shape == (3, 64)  # three classes in the folder


def test_target_accuracy_stops_early_and_records_the_time(tmp_path):
    summary, _, _ = run_tiny(
        tmp_path / "run",
        "--num-train",
        "512",
        "--batch-size",
        "32",
        "--max-steps",
        "200",
        "--lr",
        "0.5",
        "--eval-every",
        "4",
        "--target-accuracy",
        "0.5",
    )
    assert summary["eval_accuracy"] >= 0.5 and summary["steps"] < 200
    assert 0 < summary["time_to_target_seconds"] <= summary["wall_seconds"]


def test_throughput_excludes_warmup_steps_and_paused_time(monkeypatch):
    clock = iter([0.0, 10.0, 12.0, 100.0, 103.0, 110.0])
    monkeypatch.setattr("acceltrain.runtime.metrics.time.perf_counter", lambda: next(clock))
    meter = Throughput(torch.device("cpu"), warmup_steps=2)
    meter.resume(0)  # still warming up: the clock is not read
    meter.step_done(1, 50)
    meter.add_data_wait(5.0)  # not timed yet: ignored
    meter.step_done(2, 50)  # end of warm-up: clock starts at 0
    meter.step_done(3, 50)
    meter.add_data_wait(2.0)
    meter.pause()  # evaluation from t=10 ...
    meter.resume(3)  # ... to t=12 is not training time
    meter.step_done(4, 50)
    window = meter.window()  # t=100: reads and restarts the window
    assert window["samples_per_second"] == pytest.approx(100 / 98) and window["ms_per_step"] == pytest.approx(49000)
    meter.step_done(5, 50)
    totals = meter.totals()
    assert totals["samples_per_second"] == pytest.approx(150 / (10 + 88 + 7))
    assert totals["timed_steps"] == 3 and totals["data_wait_fraction"] == pytest.approx(2 / 105)
