"""Resume on another process count, batch size or accumulation (issue 22, item 2): a checkpoint continues on
any layout whose optimizer steps cover the same samples (batch size x processes x grad_accum, and the same
samples per epoch), and ends where the uninterrupted run ends, within float tolerance. Any other layout is
one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY_RECIPE, check, launch, read_events, read_summary, run_tiny_in_process
from safetensors.torch import load_file

from acceltrain.checkpoint.state import CheckpointError, RunState
from acceltrain.runtime.preemption import EXIT_PREEMPTED

# 96 samples, 2 epochs. Per-process micro-batch 4 everywhere, so BatchNorm sees the same batches in every
# layout: 2 processes x grad_accum 2 and 1 process x grad_accum 4 both take 16 samples per step, 6 steps an epoch.
COMMON = [
    "--batchnorm",
    "--num-train",
    "96",
    "--batch-size",
    "4",
    "--epochs",
    "2",
    "--lr",
    "0.05",
    "--warmup-steps",
    "2",
    "--log-every",
    "1",
    "--no-progress",
    "--num-workers",
    "0",
]
TWO = {"processes": 2, "launcher": "accelerate"}


def final_weights(output_dir: Path) -> dict:
    return load_file(str(output_dir / "model.safetensors"))


BATCHNORM_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def assert_close(a: dict, b: dict) -> None:
    """The parameters. BatchNorm's running statistics follow the micro-batches a process sees, and under DDP
    those of process 0 (it broadcasts its buffers): they differ by layout, uninterrupted runs too."""
    assert a.keys() == b.keys()
    for key in (key for key in a if not key.endswith(BATCHNORM_BUFFERS)):
        torch.testing.assert_close(a[key].float(), b[key].float(), rtol=1e-4, atol=1e-5, msg=key)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("layout") / "two"
    check(launch(TINY_RECIPE, [*COMMON, "--grad-accum", "2", "--output-dir", str(out)], **TWO))
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_resume_on_one_with_twice_the_accumulation(tmp_path, uninterrupted):
    out = tmp_path / "run"
    stopped = launch(
        TINY_RECIPE, [*COMMON, "--grad-accum", "2", "--output-dir", str(out), "--stop-after-steps", "5"], **TWO
    )
    assert "stopped at step 5" in stopped.stdout, stopped.stderr[-2000:]  # the launcher's own exit code: 1
    resumed = check(launch(TINY_RECIPE, [*COMMON, "--grad-accum", "4", "--output-dir", str(out), "--resume", "auto"]))
    assert (
        "resuming a checkpoint of 2 processes x batch 4 x grad_accum 2 = 16 samples per optimizer step on "
        "1 processes x batch 4 x grad_accum 4" in resumed.stdout
    )
    assert_close(final_weights(out), final_weights(uninterrupted))
    summary = read_summary(out)
    assert (summary["steps"], summary["resumed_from_step"], summary["samples_seen"], summary["num_processes"]) == (
        12,
        5,
        192,
        1,
    )
    assert [e["step"] for e in read_events(out) if "loss" in e] == list(range(1, 13)), "every step logged once"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_one_process_resumes_on_two_with_half_the_accumulation(tmp_path, uninterrupted):
    out = tmp_path / "run"
    stopped = launch(TINY_RECIPE, [*COMMON, "--grad-accum", "4", "--output-dir", str(out), "--stop-after-steps", "7"])
    assert stopped.returncode == EXIT_PREEMPTED, stopped.stderr[-2000:]
    check(launch(TINY_RECIPE, [*COMMON, "--grad-accum", "2", "--output-dir", str(out), "--resume", "auto"], **TWO))
    assert_close(final_weights(out), final_weights(uninterrupted))
    summary = read_summary(out)
    assert (summary["steps"], summary["resumed_from_step"], summary["num_processes"]) == (12, 7, 2)


# One process, no BatchNorm: batch 4 x grad_accum 2 continues as batch 2 x grad_accum 4 (8 samples per step)
SMALL = ["--num-train", "48", "--epochs", "2", "--lr", "0.05", "--no-progress", "--num-workers", "0"]


@pytest.mark.slow
def test_a_smaller_batch_with_more_accumulation_continues_the_same_run(tmp_path):
    full, out = tmp_path / "full", tmp_path / "run"
    assert run_tiny_in_process(full, *SMALL, "--batch-size", "4", "--grad-accum", "2") == 0
    assert (
        run_tiny_in_process(out, *SMALL, "--batch-size", "4", "--grad-accum", "2", "--stop-after-steps", "4")
        == EXIT_PREEMPTED
    )
    assert run_tiny_in_process(out, *SMALL, "--batch-size", "2", "--grad-accum", "4", "--resume", "auto") == 0
    assert_close(final_weights(out), final_weights(full))
    assert "config_changes" not in read_summary(out), "a layout that passes the check is not a config change"


@pytest.mark.parametrize(
    "samples,args,message",
    [
        (
            "48",
            ["--batch-size", "2"],
            "was written with 1 processes x batch 4 x grad_accum 2 = 8 samples per optimizer step, this "
            "run has 1 processes x batch 2 x grad_accum 2 = 4 samples per optimizer step: resume with "
            "8 samples per optimizer step (here: --grad-accum 4)",
        ),
        # 44 samples: 11 batches of 4 (windows 2, 2, 2, 2, 2, 1), but 5 batches of 8
        (
            "44",
            ["--batch-size", "8", "--grad-accum", "1"],
            "trained on 44 samples per epoch (1 processes x batch 4 x "
            "grad_accum 2 = 8 samples per optimizer step), this layout fills 40",
        ),
    ],
    ids=["samples-per-step", "samples-per-epoch"],
)
def test_another_layout_that_would_change_the_run_is_one_line(tmp_path, capsys, samples, args, message):
    out = tmp_path / "run"
    small = [*SMALL, "--num-train", samples]
    assert (
        run_tiny_in_process(out, *small, "--batch-size", "4", "--grad-accum", "2", "--stop-after-steps", "2")
        == EXIT_PREEMPTED
    )
    capsys.readouterr()
    assert run_tiny_in_process(out, *small, "--batch-size", "4", "--grad-accum", "2", *args, "--resume", "auto") == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def state(**layout) -> RunState:
    return RunState(
        **{
            "seed": 0,
            "train_samples": 96,
            "global_batch_size": 8,
            "grad_accum": 2,
            "num_processes": 2,
            "batches_per_epoch": 12,
            **layout,
        }
    )


def test_the_position_in_the_epoch_is_counted_in_the_new_layouts_batches():
    saved = state(step=3, batch_in_epoch=6)  # 3 steps of 2 micro-batches on each of 2 processes: 48 samples
    moved = saved.in_layout(state(global_batch_size=4, grad_accum=4, num_processes=1, batches_per_epoch=24))
    assert (moved.batch_in_epoch, moved.num_processes, moved.step) == (12, 1, 3)


def test_deepspeed_state_is_refused_on_another_process_count_and_fsdp_state_is_not():
    """FSDP's DCP shards reshard on load (issue 32: tests/test_fsdp.py resumes 2 -> 1 and 1 -> 2 processes)."""
    from types import SimpleNamespace

    from acceltrain.checkpoint import Checkpointer
    from acceltrain.engines import FSDP2, DeepSpeed

    def under(engine):  # a checkpointer as far as this check reads it
        return SimpleNamespace(engine=engine(None))

    deepspeed = under(DeepSpeed)
    with pytest.raises(CheckpointError, match="partitioned over 2 processes and this run has 1: resume on 2 processes"):
        Checkpointer._check_relayout_supported(
            deepspeed, state(), state(num_processes=1, global_batch_size=4, grad_accum=4), "ckpt"
        )
    Checkpointer._check_relayout_supported(
        deepspeed, state(), state(global_batch_size=16, grad_accum=1, batches_per_epoch=6), "ckpt"
    )
    fsdp = under(FSDP2)
    Checkpointer._check_relayout_supported(
        fsdp, state(), state(num_processes=1, global_batch_size=4, grad_accum=4), "ckpt"
    )
