"""Ray Train (issue 22, item 1): ``acceltrain ray`` runs a recipe unchanged under ``TorchTrainer`` on a
local Ray cluster it starts and stops (2 CPU workers, gloo); it trains as ``accelerate launch`` does, and a
worker killed mid-run is restarted by Ray and resumes to the same bytes as a run never killed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY_RECIPE, _free_port, check, launch, read_events, read_summary, subprocess_env
from safetensors.torch import load_file

pytest.importorskip("ray.train.torch", reason="the ray extra is absent: pip install -e '.[ray]' (.ci/run installs it)")

ARGS = [
    "--batchnorm",
    "--num-train",
    "96",
    "--batch-size",
    "4",
    "--epochs",
    "1",
    "--lr",
    "0.05",
    "--no-progress",
    "--num-workers",
    "0",
    "--save-every-steps",
    "4",
    "--log-every",
    "1",
]


def ray_launch(
    tmp_path: Path, *args: str, workers: int = 2, timeout: int = 600, **env: str
) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "acceltrain.commands.cli",
        "ray",
        "--num-workers",
        str(workers),
        "--storage-path",
        str(tmp_path / "ray"),
        *args,
    ]
    return subprocess.run(command, cwd=REPO, env=subprocess_env(**env), capture_output=True, text=True, timeout=timeout)


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def ray_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ray")
    ok(ray_launch(root, str(TINY_RECIPE), *ARGS, "--output-dir", str(root / "run")))
    return root / "run"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_ray_run_trains_as_accelerate_launch_does(tmp_path, ray_run):
    reference = tmp_path / "accelerate"
    check(launch(TINY_RECIPE, [*ARGS, "--output-dir", str(reference)], processes=2, launcher="accelerate"))
    summary = read_summary(ray_run)
    assert (summary["num_processes"], summary["distributed_type"], summary["steps"]) == (2, "MULTI_CPU", 12)
    a, b = load_file(str(ray_run / "model.safetensors")), load_file(str(reference / "model.safetensors"))
    for key in b:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)
    reported = [path for path in (ray_run.parent / "ray").glob("*/checkpoint_*") if path.is_dir()]
    assert len(reported) == 3, "each published checkpoint reported to Ray"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_worker_killed_mid_run_is_restarted_by_ray_and_ends_byte_identical(tmp_path, ray_run):
    out = tmp_path / "run"
    result = ok(
        ray_launch(
            tmp_path, "--max-failures", "1", str(TINY_RECIPE), *ARGS, "--die-at-step", "6", "--output-dir", str(out)
        )
    )
    assert "resumed from" in result.stdout + result.stderr
    assert read_summary(out)["resumed_from_step"] == 4
    assert (out / "model.safetensors").read_bytes() == (ray_run / "model.safetensors").read_bytes()
    assert [e["step"] for e in read_events(out) if "loss" in e] == list(range(1, 13))


def test_bad_launcher_input_is_one_line(tmp_path):
    result = ray_launch(tmp_path, str(tmp_path / "missing.py"))
    assert (
        result.returncode == 2
        and result.stderr.strip() == f"error: recipe {str(tmp_path / 'missing.py')!r} is not a file"
    )


@pytest.mark.slow
def test_an_address_where_no_cluster_answers_is_one_line_before_ray_starts(tmp_path):
    """Issue 31 item 14: Ray retried its connection to the cluster's GCS there for minutes, without a line."""
    address = f"127.0.0.1:{_free_port()}"  # nothing listens: Ray would connect to this node's own address, port alike
    result = ray_launch(
        tmp_path, "--address", address, str(TINY_RECIPE), "--output-dir", str(tmp_path / "run"), timeout=240
    )
    (line,) = result.stderr.strip().splitlines()
    assert result.returncode == 2 and line.startswith(f"error: --address {address!r}: no Ray cluster answered at "), (
        line
    )
    assert "ray start --head" in line and not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--lr", "-1"], ["--no-such-flag"]])
def test_a_bad_recipe_flag_is_the_recipes_own_line_before_ray_starts(tmp_path, flags):
    """Issue 31 item 15: the recipe's flags were first parsed in the workers, after Ray had started."""
    run = ["--output-dir", str(tmp_path / "run")]
    direct = launch(TINY_RECIPE, [*flags, *run])
    result = ray_launch(tmp_path, str(TINY_RECIPE), *flags, *run, workers=1)
    assert direct.returncode == result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip() == direct.stderr.strip() and result.stdout == ""  # one line: Ray said nothing


@pytest.mark.slow
@pytest.mark.multiprocess
def test_bad_input_found_in_a_worker_fails_once_with_its_line(tmp_path):
    """Issue 31 item 16: a worker's exit 2 became a RuntimeError, so Ray ran the bad input again --max-failures
    times and acceltrain ray exited 1. The batch size is checked against the data, in the worker."""
    result = ray_launch(
        tmp_path,
        "--max-failures",
        "2",
        str(TINY_RECIPE),
        "--batch-size",
        "100000",
        "--no-progress",
        "--output-dir",
        str(tmp_path / "run"),
        workers=1,
        RAY_DEDUP_LOGS="0",
    )
    line = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and line.startswith("error: --batch-size 100000 is too large: "), result.stderr[
        -3000:
    ]
    ran_in = set(re.findall(r"RayTrainWorker pid=(\d+)[^\n]*error: --batch-size", result.stderr))
    assert len(ran_in) <= 1, f"the bad input ran in {len(ran_in)} worker processes: Ray retried it"
