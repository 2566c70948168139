"""Checkpoints: atomic, verified, rotated; resume is exact (byte-identical final weights) wherever the run
stopped, on 1 and 2 processes, with and without loader workers, after SIGTERM and after SIGKILL."""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY_RECIPE, check, launch, read_events, read_summary, run_tiny_in_process, subprocess_env

from acceltrain.checkpoint.files import checkpoint_dir, complete_checkpoints, verify_checkpoint
from acceltrain.runtime.preemption import EXIT_PREEMPTED

# 40 samples, batch 4, accumulate 3: 10 batches an epoch in windows of 3, 3, 3 and 1: 4 steps an epoch.
RUN = [
    "--num-train",
    "40",
    "--batch-size",
    "4",
    "--grad-accum",
    "3",
    "--epochs",
    "3",
    "--lr",
    "0.05",
    "--warmup-steps",
    "2",
    "--batchnorm",
    "--no-progress",
    "--log-every",
    "1",
    "--eval-every",
    "3",
]


def run_tiny(output_dir: Path, *args: str) -> int:
    return run_tiny_in_process(output_dir, *RUN, *args)


def weights(output_dir: Path) -> bytes:
    return (output_dir / "model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    results = {}
    for workers in ("0", "2"):
        out = tmp_path_factory.mktemp(f"full{workers}")
        assert run_tiny(out, "--num-workers", workers) == 0
        results[workers] = out
    return results


@pytest.mark.slow
@pytest.mark.parametrize(
    "stop_at,workers",
    [(4, "0"), (5, "0"), (7, "0"), (5, "2")],
    ids=["epoch-boundary", "mid-epoch", "before-partial-window", "mid-epoch-workers"],
)
def test_resume_is_byte_identical(tmp_path, uninterrupted, stop_at, workers):
    out = tmp_path / "run"
    assert run_tiny(out, "--num-workers", workers, "--stop-after-steps", str(stop_at)) == EXIT_PREEMPTED
    assert [p.name for p in complete_checkpoints(out)] == [f"step_{stop_at:08d}"]
    assert run_tiny(out, "--num-workers", workers, "--resume", "auto") == 0
    assert weights(out) == weights(uninterrupted[workers])
    summary = read_summary(out)
    assert (summary["steps"], summary["resumed_from_step"], summary["samples_seen"]) == (12, stop_at, 120)
    steps = [e["step"] for e in read_events(out) if "loss" in e]
    assert steps == list(range(1, 13)), "every step logged once, none lost or repeated"


@pytest.mark.slow
def test_resume_auto_without_checkpoint_starts_fresh(tmp_path, uninterrupted, capsys):
    out = tmp_path / "run"
    assert run_tiny(out, "--resume", "auto", "--num-workers", "0") == 0
    assert "no complete checkpoint" in capsys.readouterr().out
    assert weights(out) == weights(uninterrupted["0"])


@pytest.mark.slow
def test_two_processes_resume_byte_identical(tmp_path):
    """With a stateful hook too: the EMA's average (exported as model.safetensors) continues exactly. The run
    continues from the uninterrupted run's own step-5 checkpoint (one launch fewer than a stop; stops are the
    checkpoint matrix's)."""
    args = [*RUN, "--num-workers", "1", "--batch-size", "2", "--sync-bn", "--ema-decay", "0.9"]
    full, part = tmp_path / "full", tmp_path / "part"
    check(
        launch(
            TINY_RECIPE,
            [*args, "--output-dir", str(full), "--save-every-steps", "5"],
            processes=2,
            launcher="accelerate",
        )
    )
    step_5 = checkpoint_dir(full, 5)
    check(
        launch(
            TINY_RECIPE, [*args, "--output-dir", str(part), "--resume", str(step_5)], processes=2, launcher="accelerate"
        )
    )
    assert weights(part) == weights(full)
    assert (part / "rank1.safetensors").read_bytes() == (full / "rank1.safetensors").read_bytes()


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(TINY_RECIPE), *args],
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(predicate, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


LONG = [
    "--num-train",
    "8192",
    "--batch-size",
    "16",
    "--grad-accum",
    "2",
    "--epochs",
    "1",
    "--lr",
    "0.05",
    "--no-progress",
    "--log-every",
    "1",
    "--num-workers",
    "0",
    "--batchnorm",
]


@pytest.fixture(scope="module")
def long_uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("long")
    check(launch(TINY_RECIPE, [*LONG, "--output-dir", str(out)]))
    return out


@pytest.mark.slow
def test_sigterm_checkpoints_exits_75_and_resume_is_identical(tmp_path, long_uninterrupted):
    out = tmp_path / "run"
    process = _start([*LONG, "--output-dir", str(out)])
    # an unpredictable step, often inside an accumulation window; counted, not timed: on any machine well
    # before the last of 256 (a fixed sleep could outlast a fast machine's whole run)
    logged = random.randint(1, 20)
    _wait_for(
        lambda: (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= logged
    )
    process.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    process.send_signal(signal.SIGTERM)  # a second signal while stopping/saving changes nothing
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == EXIT_PREEMPTED, stdout[-3000:] + stderr[-2000:]
    stopped_at = int(re.search(r"stopped at step (\d+) \(SIGTERM\)", stdout).group(1))
    assert 0 < stopped_at < 256
    check(launch(TINY_RECIPE, [*LONG, "--output-dir", str(out), "--resume", "auto"]))
    assert weights(out) == weights(long_uninterrupted)


@pytest.mark.slow
def test_sigkill_during_saves_never_leaves_a_half_checkpoint(tmp_path, long_uninterrupted):
    out = tmp_path / "run"
    process = _start([*LONG, "--output-dir", str(out), "--save-every-steps", "1"])
    _wait_for(lambda: len(complete_checkpoints(out)) >= 2)
    time.sleep(random.uniform(0.0, 0.3))
    process.kill()
    process.communicate()
    for checkpoint in complete_checkpoints(out):
        verify_checkpoint(checkpoint)  # every visible checkpoint is whole
    # the rest saves rarely (a free option on resume): its first save clears the killed save's leftovers
    check(launch(TINY_RECIPE, [*LONG, "--output-dir", str(out), "--save-every-steps", "100", "--resume", "auto"]))
    assert weights(out) == weights(long_uninterrupted)
    assert not list((out / "checkpoints").glob(".tmp-*")), "leftovers of the killed save are cleaned up"


@pytest.fixture
def two_checkpoints(tmp_path):
    out = tmp_path / "run"
    assert run_tiny(out, "--num-workers", "0", "--save-every-steps", "2", "--stop-after-steps", "4") == EXIT_PREEMPTED
    older, newer = complete_checkpoints(out)
    return out, older, newer


@pytest.mark.parametrize(
    "damage,message", [("truncate", "is truncated"), ("flip", "is corrupted"), ("marker", "is incomplete")]
)
def test_damaged_checkpoint_named_explicitly_is_a_one_line_error(two_checkpoints, capsys, damage, message):
    out, _, newer = two_checkpoints
    target = newer / "model.safetensors"
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:100])
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[-1] ^= 0xFF
        target.write_bytes(bytes(data))
    else:
        (newer / "COMPLETE").unlink()
    assert run_tiny(out, "--num-workers", "0", "--resume", str(newer)) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert (str(target) in err) or (str(newer) in err)


def test_resume_auto_skips_a_corrupted_checkpoint_and_stays_exact(two_checkpoints, uninterrupted, capsys):
    out, older, newer = two_checkpoints
    (newer / "optimizer.bin").write_bytes(b"garbage")
    assert run_tiny(out, "--num-workers", "0", "--resume", "auto") == 0
    captured = capsys.readouterr().out
    assert "skipping checkpoint" in captured and f"resumed from {older}" in captured
    assert weights(out) == weights(uninterrupted["0"])


def test_resume_with_a_different_global_batch_is_refused(two_checkpoints, capsys):
    out, _, _ = two_checkpoints
    assert run_tiny(out, "--num-workers", "0", "--resume", "auto", "--batch-size", "2") == 2
    err = capsys.readouterr().err  # fewer samples per optimizer step: refused, naming the accumulation that fits
    assert (
        "this run has 1 processes x batch 2 x grad_accum 3 = 6 samples per optimizer step: resume with 12 samples "
        "per optimizer step (here: --grad-accum 6)" in err
    )


@pytest.mark.slow
def test_rotation_keeps_the_newest_and_the_best(tmp_path):
    out = tmp_path / "run"
    assert (
        run_tiny(
            out, "--num-workers", "0", "--save-every-steps", "1", "--keep-last", "2", "--keep-best", "--eval-every", "1"
        )
        == 0
    )
    kept = [p.name for p in complete_checkpoints(out)]
    events = [e for e in read_events(out) if "eval_accuracy" in e]
    best_step = max(events, key=lambda e: (e["eval_accuracy"], -e["step"]))["step"]
    expected = {f"step_{best_step:08d}", "step_00000011", "step_00000012"}
    assert set(kept) == expected  # the newest two plus the best (fewer when the best is among the newest)
    state = json.loads((out / "checkpoints" / "step_00000012" / "hooks" / "CheckpointSchedule.json").read_text())
    assert state["best_checkpoint"] == f"step_{best_step:08d}"  # the hook's own state_dict()


def test_toolkit_never_calls_torch_load_without_weights_only():
    sources = list((REPO / "acceltrain").rglob("*.py"))
    assert any(path.parent.name == "hooks" for path in sources), "subpackages are scanned too"
    for source in sources:
        for call in re.findall(r"torch\.load\([^)]*\)", source.read_text()):
            assert "weights_only=True" in call, f"{source.relative_to(REPO)}: {call}"
        assert "pickle.load" not in source.read_text(), source


def test_rotation_orders_by_step_not_by_name_or_save_count(tmp_path):
    """accelerate#1163, #1601: total_limit deleted the wrong folder and the save counter was lost on resume.
    Checkpoints here are named by global step and rotated by it; nothing to restore."""
    from acceltrain.checkpoint.files import rotate_checkpoints

    for step in (9, 10, 100, 1000):
        folder = tmp_path / "checkpoints" / f"step_{step:08d}"
        folder.mkdir(parents=True)
        (folder / "COMPLETE").write_text("{}")
    (tmp_path / "checkpoints" / "step_00000011").mkdir()  # incomplete: not a checkpoint, left alone
    (tmp_path / "checkpoints" / ".tmp-step_00001001").mkdir()  # an interrupted save: removed
    rotate_checkpoints(
        tmp_path, keep_last=2, best="step_00000009", verified={f"step_{s:08d}" for s in (9, 10, 100, 1000)}
    )
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert left == ["step_00000009", "step_00000011", "step_00000100", "step_00001000"]
