"""--async-checkpoint (issue 32, item 5): training goes on while a checkpoint is written, which counts only once
complete (manifest last); a stop waits for it; a run killed with a save in flight resumes from the previous
checkpoint; a disk that fills during the write is one line. The same bytes as synchronous saves, on one process
here and under FSDP in tests/test_fsdp.py."""

from __future__ import annotations

import errno
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import REPO, TINY_RECIPE, check, launch, read_events, read_summary, run_tiny_in_process, subprocess_env

from acceltrain import ConfigError, Hook
from acceltrain.checkpoint.files import complete_checkpoints
from acceltrain.runtime.preemption import EXIT_PREEMPTED

RUN = [
    "--batchnorm",
    "--batch-size",
    "4",
    "--max-steps",
    "12",
    "--lr",
    "0.05",
    "--no-progress",
    "--num-workers",
    "0",
    "--report-to",
    "none",
    "--save-every-steps",
    "3",
    "--log-every",
    "1",
]


@pytest.fixture(scope="module")
def synchronous(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sync") / "run"
    assert run_tiny_in_process(out, *RUN) == 0
    return out


def weights(out: Path) -> bytes:
    return (out / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_async_saves_write_the_same_checkpoints_and_a_stop_waits_for_its_own(tmp_path, synchronous):
    full, part = tmp_path / "full", tmp_path / "part"
    assert run_tiny_in_process(full, *RUN, "--async-checkpoint") == 0
    assert weights(full) == weights(synchronous)
    assert [p.name for p in complete_checkpoints(full)] == [p.name for p in complete_checkpoints(synchronous)]
    assert run_tiny_in_process(part, *RUN, "--async-checkpoint", "--stop-after-steps", "7") == EXIT_PREEMPTED
    assert complete_checkpoints(part)[-1].name == "step_00000007", "the stop waited for its save to be published"
    assert run_tiny_in_process(part, *RUN, "--async-checkpoint", "--resume", "auto") == 0
    assert weights(part) == weights(synchronous)
    for out in (synchronous, full):  # both modes report the time saves blocked training
        assert read_summary(out)["checkpoint_seconds"] >= 0
        assert [row["step"] for row in read_events(out) if "checkpoint_seconds" in row] == [3, 6, 9]


class Published(Hook):
    """The checkpoints ``on_save`` announced, in order."""

    def __init__(self):
        self.folders = []

    def on_save(self, run, folder):
        self.folders.append(folder.name)


def test_every_async_checkpoint_is_announced_when_published_even_when_the_next_save_waits_for_it(tmp_path):
    """Before: a save that found the previous one still in flight published it itself, without on_save (no rotation,
    no Ray report, no log line for it)."""
    published, out = Published(), tmp_path / "run"
    assert run_tiny_in_process(out, *RUN, "--save-every-steps", "1", "--async-checkpoint", hooks=[published]) == 0
    assert published.folders == [p.name for p in complete_checkpoints(out)] == [f"step_{s:08d}" for s in range(1, 13)]


class CopyBeforeStep(Hook):
    """Records whether the writer thread's copy of a save came before the optimizer step after it: the thread's copy
    is held back until that step is about to run (``on_before_optimizer_step``), so that a step which did not wait
    for it would change the weights under it."""

    def __init__(self):
        self.events, self.gate = [], threading.Event()

    def on_fit_start(self, run):
        optimizer = run.optimizer.optimizer  # after the checkpointer's own pre-hook: what the step sees once it waited
        optimizer.register_step_pre_hook(lambda *_: self.events.append(("step", run.step + 1)))

    def on_save(self, run, folder):
        self.events.append(("published", folder.name))

    def on_before_optimizer_step(self, run):
        self.gate.set()


def test_an_async_save_copies_the_weights_while_the_next_step_trains_and_that_step_waits_for_the_copy(
    tmp_path, monkeypatch, synchronous
):
    """The buffers (BatchNorm's statistics change in every training forward) are copied at the save, the weights and
    optimizer state by the writer thread; the next optimizer step waits for that copy. Every checkpoint's bytes are
    the synchronous run's."""
    from acceltrain.checkpoint import writers

    recorder, original = CopyBeforeStep(), writers.AsyncWriter._copy

    def held_back(writer, part, keys):
        if threading.current_thread() is threading.main_thread():
            return original(writer, part, keys)
        recorder.gate.wait()
        result = original(writer, part, keys)
        recorder.events.append(("copied", part.name))
        return result

    monkeypatch.setattr(writers.AsyncWriter, "_copy", held_back)
    out = tmp_path / "run"
    assert run_tiny_in_process(out, *RUN, "--async-checkpoint", hooks=[recorder]) == 0
    first_save = recorder.events.index(("step", 4)) - 2
    assert recorder.events[first_save : first_save + 3] == [
        ("copied", "model.safetensors"),
        ("copied", "optimizer.bin"),
        ("step", 4),
    ], recorder.events
    assert read_summary(out)["checkpoint_wait_seconds"] >= 0  # counted in checkpoint_seconds
    for mine, theirs in zip(complete_checkpoints(out), complete_checkpoints(synchronous), strict=True):
        for name in ("model.safetensors", "optimizer.bin"):
            assert (mine / name).read_bytes() == (theirs / name).read_bytes(), (mine.name, name)


# In the child: the model file of the step-6 save never finishes writing (a slow disk), so that the run is
# killed with that save in flight.
SLOW_WRITE = """
import runpy, sys, time
from acceltrain.checkpoint import writers
original = writers.write_part
def write_part(part, folder, process_group=None):
    if 'step_00000006' in str(folder):
        time.sleep(3600)
    return original(part, folder, process_group)
writers.write_part = write_part
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name='__main__')
"""


@pytest.mark.slow
def test_training_goes_on_while_a_save_is_written_and_a_kill_then_leaves_the_previous_checkpoint(tmp_path):
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-c",
        SLOW_WRITE,
        str(TINY_RECIPE),
        *RUN,
        "--sleep-per-step",
        "0.2",
        "--async-checkpoint",
        "--output-dir",
        str(out),
    ]
    child = subprocess.Popen(
        command, cwd=REPO, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 300  # a hang guard
        while not any(row.get("step", 0) >= 8 and "loss" in row for row in _rows(out)):
            assert child.poll() is None and time.monotonic() < deadline, "the run did not get past its step-6 save"
            time.sleep(0.1)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert [p.name for p in complete_checkpoints(out)] == ["step_00000003"], "a checkpoint counts only once complete"
    assert (out / "checkpoints" / ".tmp-step_00000006" / "trainer_state.json").is_file()
    assert not (out / "checkpoints" / ".tmp-step_00000006" / "COMPLETE").exists()
    # the rest as the child ran (one thread, conftest's environment), to compare bytes with a run of the same kind
    check(
        launch(
            TINY_RECIPE,
            [*RUN, "--sleep-per-step", "0.2", "--async-checkpoint", "--resume", "auto", "--output-dir", str(out)],
        )
    )
    reference = tmp_path / "reference"
    check(launch(TINY_RECIPE, [*RUN, "--output-dir", str(reference)]))
    assert read_summary(out)["resumed_from_step"] == 3 and weights(out) == weights(reference)
    assert not (out / "checkpoints" / ".tmp-step_00000006").exists(), "the leftover is cleared at the next save"


def _rows(out: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.endswith("}")]
    except FileNotFoundError:
        return []


def test_a_disk_that_fills_during_an_async_write_is_one_line_and_keeps_the_previous_checkpoints(
    tmp_path, monkeypatch, capsys
):
    from acceltrain.checkpoint import writers

    original = writers.write_part

    def full_disk(part, folder, process_group=None):
        if "step_00000006" in str(folder):
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(part, folder, process_group)

    monkeypatch.setattr(writers, "write_part", full_disk)
    out = tmp_path / "run"
    assert run_tiny_in_process(out, *RUN, "--async-checkpoint") == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: could not write checkpoint {str(out / 'checkpoints' / 'step_00000006')!r}: No space left on device; "
        "the previous checkpoints are intact (free space and continue with --resume auto)"
    ), err
    assert [p.name for p in complete_checkpoints(out)] == ["step_00000003"]
    assert not list((out / "checkpoints").glob(".tmp-*"))


def test_async_saves_are_refused_where_they_cannot_work():
    from acceltrain.engines import DDP, FSDP2, DeepSpeed

    with pytest.raises(
        ConfigError, match="--async-checkpoint works under DDP and FSDP; DeepSpeed writes its checkpoints itself"
    ):
        DeepSpeed(SimpleNamespace()).check_async_supported()
    full = SimpleNamespace(
        state=SimpleNamespace(fsdp_plugin=SimpleNamespace(state_dict_type="StateDictType.FULL_STATE_DICT")),
    )
    with pytest.raises(ConfigError, match="under FSDP needs fsdp_state_dict_type: SHARDED_STATE_DICT"):
        FSDP2(full).check_async_supported()
    DDP(SimpleNamespace()).check_async_supported()


class KeepsTheOptimizer(Hook):
    def on_fit_start(self, run):
        self.optimizer = getattr(run.optimizer, "optimizer", run.optimizer)


@pytest.mark.parametrize("stop", [[], ["--stop-after-steps", "4"]], ids=["finished", "stopped"])
def test_nothing_of_the_async_writer_outlives_the_run(tmp_path, stop):
    """Before: the step pre-hook the async writer set on the user's optimizer stayed, and through it the optimizer
    kept the checkpointer alive, with the writer's gloo groups (their threads outlived the run, 3-4 per rank)."""
    kept = KeepsTheOptimizer()
    code = run_tiny_in_process(tmp_path / "run", *RUN, "--async-checkpoint", *stop, hooks=[kept])
    assert code == (EXIT_PREEMPTED if stop else 0)
    assert not kept.optimizer._optimizer_step_pre_hooks, "the optimizer holds nothing of the run's checkpointing"
