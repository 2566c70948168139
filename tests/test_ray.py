"""Ray Train (issue 22, item 1): ``acceltrain ray`` runs a recipe unchanged under ``TorchTrainer`` on a
local Ray cluster it starts and stops (2 CPU workers, gloo); it trains as ``accelerate launch`` does, and a
worker killed mid-run is restarted by Ray and resumes to the same bytes as a run never killed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, TINY_RECIPE, check, launch, read_events, read_summary, subprocess_env

pytest.importorskip("ray.train.torch", reason="the ray extra is absent: pip install -e '.[ray]' (.ci/run installs it)")

ARGS = ["--batchnorm", "--num-train", "96", "--batch-size", "4", "--epochs", "2", "--lr", "0.05", "--no-progress",
        "--num-workers", "0", "--save-every-steps", "4", "--log-every", "1"]


def ray_launch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "acceltrain.cli", "ray", "--num-workers", "2", "--storage-path", str(tmp_path / "ray"), *args]
    return subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def ray_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ray")
    ok(ray_launch(root, str(TINY_RECIPE), *ARGS, "--output-dir", str(root / "run")))
    return root / "run"


@pytest.mark.multiprocess
def test_a_ray_run_trains_as_accelerate_launch_does(tmp_path, ray_run):
    reference = tmp_path / "accelerate"
    check(launch(TINY_RECIPE, [*ARGS, "--output-dir", str(reference)], processes=2, launcher="accelerate"))
    summary = read_summary(ray_run)
    assert (summary["num_processes"], summary["distributed_type"], summary["steps"]) == (2, "MULTI_CPU", 24)
    a, b = load_file(str(ray_run / "model.safetensors")), load_file(str(reference / "model.safetensors"))
    for key in b:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)
    reported = [path for path in (ray_run.parent / "ray").glob("*/checkpoint_*") if path.is_dir()]
    assert len(reported) == 6, "each published checkpoint reported to Ray"


@pytest.mark.multiprocess
def test_a_worker_killed_mid_run_is_restarted_by_ray_and_ends_byte_identical(tmp_path, ray_run):
    out = tmp_path / "run"
    result = ok(ray_launch(tmp_path, "--max-failures", "1", str(TINY_RECIPE), *ARGS, "--die-at-step", "10", "--output-dir", str(out)))
    assert "resumed from" in result.stdout + result.stderr
    assert read_summary(out)["resumed_from_step"] == 8
    assert (out / "model.safetensors").read_bytes() == (ray_run / "model.safetensors").read_bytes()
    assert [e["step"] for e in read_events(out) if "loss" in e] == list(range(1, 25))


def test_bad_launcher_input_is_one_line(tmp_path):
    result = ray_launch(tmp_path, str(tmp_path / "missing.py"))
    assert result.returncode == 2 and result.stderr.strip() == f"error: recipe {str(tmp_path / 'missing.py')!r} is not a file"
