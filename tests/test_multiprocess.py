"""Real multi-process runs on CPU over gloo, launched as a user would (accelerate launch, torchrun)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
import torch
from conftest import RECIPE, REPO, TINY_RECIPE, check, launch, read_events, read_summary, subprocess_env
from safetensors.torch import load_file

from acceltrain.train.optim import lr_multiplier

pytestmark = pytest.mark.multiprocess

# 96 samples, per-process batch 4 on 2 processes (8 per step), accumulate 5: 12 batches per process per
# epoch, windows of 5, 5 and 2 micro-batches, 3 optimizer steps per epoch. 37 eval samples: uneven.
COMMON = [
    "--batchnorm",
    "--num-train",
    "96",
    "--num-eval",
    "37",
    "--grad-accum",
    "5",
    "--epochs",
    "2",
    "--lr",
    "0.05",
    "--warmup-steps",
    "1",
    "--log-every",
    "1",
    "--no-progress",
    "--num-workers",
    "0",
]


@pytest.fixture(scope="module", params=["mean-loss", "summed-loss"])
def ddp_and_single(request, tmp_path_factory):
    """The summed-loss variant returns (loss sum, target count) with uneven counts per process."""
    root = tmp_path_factory.mktemp("ddp")
    common = COMMON + (["--masked-loss"] if request.param == "summed-loss" else [])
    ddp = check(
        launch(
            TINY_RECIPE,
            [*common, "--batch-size", "4", "--sync-bn", "--output-dir", str(root / "ddp")],
            processes=2,
            launcher="accelerate",
        )
    )
    check(launch(TINY_RECIPE, [*common, "--batch-size", "8", "--output-dir", str(root / "single")]))
    return root / "ddp", root / "single", ddp


@pytest.mark.slow
def test_accelerate_launch_with_multi_cpu_config_runs_two_gloo_processes(ddp_and_single):
    ddp_dir, _, result = ddp_and_single
    summary = read_summary(ddp_dir)
    assert (summary["num_processes"], summary["distributed_type"]) == (2, "MULTI_CPU")
    assert result.stdout.count("done: ") == 1, "only the main process reports"


@pytest.mark.slow
def test_both_ranks_end_with_identical_weights(ddp_and_single):
    ddp_dir, _, _ = ddp_and_single
    rank0, rank1 = (load_file(str(ddp_dir / f"rank{r}.safetensors")) for r in (0, 1))
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)


def test_two_processes_at_batch_b_match_one_process_at_batch_2b(ddp_and_single):
    """Same samples, same augmentation, global-batch BatchNorm (--sync-bn), same partial last window."""
    ddp_dir, single_dir, _ = ddp_and_single
    ddp, single = load_file(str(ddp_dir / "rank0.safetensors")), load_file(str(single_dir / "rank0.safetensors"))
    for key in single:
        torch.testing.assert_close(ddp[key].float(), single[key].float(), rtol=1e-4, atol=1e-5)
    assert read_summary(ddp_dir)["samples_seen"] == read_summary(single_dir)["samples_seen"] == 2 * 96


def test_step_zero_grad_and_schedule_counts_per_process(ddp_and_single):
    ddp_dir, _, _ = ddp_and_single
    total = 2 * 3
    expected_lrs = [0.05 * lr_multiplier(i, total_steps=total, warmup_steps=1, schedule="cosine") for i in range(total)]
    for rank in (0, 1):
        counts = json.loads((ddp_dir / f"rank{rank}.json").read_text())
        assert counts["steps"] == counts["zero_grads"] == total
        assert counts["lrs"] == pytest.approx(expected_lrs)
    assert read_summary(ddp_dir)["final_lr"] == pytest.approx(0.0, abs=1e-12)


def test_no_process_group_outlives_the_run(ddp_and_single):
    """A gloo group still alive when a process exits, while another still runs, can abort it at exit ("terminate
    called without an active exception", SIGABRT) after its work is done: a run that succeeded fails. torch's and
    DeepSpeed's functions that take the default group as a default argument keep it alive when imported after it
    was created."""
    ddp_dir, _, _ = ddp_and_single
    for rank in (0, 1):
        assert json.loads((ddp_dir / f"rank{rank}.json").read_text())["gloo_threads_after_fit"] == []


def test_uneven_eval_set_is_counted_exactly_once_across_ranks(ddp_and_single):
    ddp_dir, single_dir, _ = ddp_and_single
    evals = [e for e in read_events(ddp_dir) if "eval_samples" in e]
    assert evals and all(e["eval_samples"] == 37 for e in evals)
    assert read_summary(ddp_dir)["eval_accuracy"] == pytest.approx(
        read_summary(single_dir)["eval_accuracy"], abs=1 / 37
    )


@pytest.mark.slow
def test_torchrun_runs_the_unchanged_recipe(tmp_path):
    out = tmp_path / "run"
    check(
        launch(
            RECIPE,
            [
                "--dataset",
                "synthetic",
                "--model",
                "resnet_tiny",
                "--batch-size",
                "16",
                "--max-steps",
                "4",
                "--output-dir",
                str(out),
                "--no-progress",
                "--num-workers",
                "1",
            ],
            processes=2,
            launcher="torchrun",
        )
    )
    summary = read_summary(out)
    assert (summary["num_processes"], summary["distributed_type"], summary["samples_seen"]) == (2, "MULTI_CPU", 4 * 32)


@pytest.mark.slow
def test_the_gpu_fsdp_config_on_cpu_runs_fsdp_not_ddp(tmp_path):
    """On CPU Accelerate drops the FSDP plugin and runs plain DDP; the toolkit sets FSDP2 up instead (issue 32), and
    the CIFAR recipe runs sharded under the GPU config unchanged."""
    out = tmp_path / "out"
    check(
        launch(
            RECIPE,
            ["--dataset", "synthetic", "--model", "resnet_tiny", "--max-steps", "2", "--output-dir", str(out)],
            processes=2,
            launcher="accelerate",
            config="fsdp.yaml",
            launcher_args=("--mixed_precision", "no"),
        )
    )
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["distributed_type"], summary["num_processes"]) == ("FSDP", 2)
    assert summary["runtime"]["parameters_per_process"] < 0.6 * summary["runtime"]["parameters"]


@pytest.mark.slow
@pytest.mark.parametrize("fail_rank,error", [(0, "os"), (0, "config"), (1, "os")])
def test_a_failure_on_main_process_first_stops_every_process_instead_of_hanging(tmp_path, fail_rank, error):
    from conftest import REPO

    result = launch(
        REPO / "tests" / "helpers" / "main_first_failure.py",
        ["--fail-rank", str(fail_rank), "--error", error, "--report-dir", str(tmp_path)],
        processes=2,
        launcher="accelerate",
        timeout=120,
    )
    lines = sorted(path.read_text() for path in tmp_path.glob("rank*.txt"))
    assert result.returncode != 0 and len(lines) == 2, result.stdout + result.stderr[-2000:]
    if error == "config":  # the other process repeats the main process's one line
        assert lines == [
            "rank 0: ConfigError: --data-dir 'x' is broken",
            "rank 1: ConfigError: --data-dir 'x' is broken",
        ]
    else:
        assert f"rank {fail_rank}: OSError: disk full" in lines
        assert f"rank {1 - fail_rank}: RuntimeError: another process failed: disk full" in lines


@pytest.mark.slow
@pytest.mark.parametrize("main_process_lag", ["0", "1"])
def test_under_torchrun_the_launchers_failure_report_names_the_one_line_error(main_process_lag):
    """torchrun's ChildFailedError table shows each worker's error file as the root cause: the one line,
    not "To enable traceback see ..." (the launcher's own traceback and exit code 1 remain its own).
    The main process prints the line even when another process failed first (torchrun then SIGTERMs the rest)."""
    result = launch(
        TINY_RECIPE, ["--lr", "0"], processes=2, launcher="torchrun", TINY_MAIN_PROCESS_LAG_SECONDS=main_process_lag
    )
    assert result.returncode != 0
    line = "error: --lr 0.0 is invalid: must be a number > 0"
    before, root_cause = result.stderr.split("Root Cause")
    assert line + "\n" in before, result.stderr  # printed by rank 0, before the launcher's report
    assert line in root_cause and "To enable traceback" not in root_cause


@pytest.mark.parametrize("code,ends", [(2, "by the launcher's SIGTERM"), (130, "at once")])
def test_a_failing_process_other_than_the_main_one_waits_only_until_the_launcher_stops_it(code, ends):
    """Its wait for the main process ends with the launcher's SIGTERM even while the loop's preemption handler
    (which only sets a flag) is still installed, as after a divergence inside fit; a second Ctrl-C does not wait."""
    probe = (
        "import os, sys, time; os.environ['RANK'] = '1'\n"
        # only the SIGTERM can end the wait
        "import acceltrain.runtime.preemption; acceltrain.runtime.preemption.MAIN_PROCESS_GRACE_SECONDS = 3600\n"
        "sleep = time.sleep; time.sleep = lambda s: (print('waiting', flush=True), sleep(s))\n"
        "from acceltrain.runtime.preemption import PreemptionSignals; PreemptionSignals().install()\n"
        f"from acceltrain.commands.cli import _fail; print('failing', flush=True); _fail('boom', {code})"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", probe], cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline() == "failing\n"
    if code == 2:
        assert process.stdout.readline() == "waiting\n"
        process.send_signal(signal.SIGTERM)
    returncode = process.wait(timeout=120)  # a hang guard: the wait would last an hour
    assert returncode == (-signal.SIGTERM if code == 2 else code), f"exit {returncode}: the wait did not end {ends}"
    assert code == 2 or "waiting" not in process.stdout.read()


@pytest.mark.slow
def test_a_time_budget_stops_every_process_at_the_same_step_with_the_same_learning_rates(tmp_path):
    """The main process's clock decides (one broadcast per step): ranks never disagree on the lr or the end."""
    check(
        launch(
            TINY_RECIPE,
            [
                "--batch-size",
                "4",
                "--epochs",
                "1000",
                "--sleep-per-step",
                "0.03",
                "--time-budget-minutes",
                "0.04",
                "--no-progress",
                "--num-workers",
                "0",
                "--output-dir",
                str(tmp_path),
            ],
            processes=2,
            launcher="accelerate",
        )
    )
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0["lrs"] == rank1["lrs"] and rank0["steps"] == read_summary(tmp_path)["steps"] < 1000
    assert read_summary(tmp_path)["final_lr"] < rank0["lrs"][0], (
        "the schedule decays over the budget"
    )  # how far: test_time_budget
