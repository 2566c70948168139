"""One state model: a Run's public surface is one documented list, all read-only; what survives a resume is
its RunState (which is trainer_state.json) or a hook's own state_dict(), built-in hooks included; the core
reports the training loss itself; and a checkpoint written before RunState still resumes exactly."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import pytest
from conftest import read_events, read_summary, run_tiny_in_process

import acceltrain.train.loop
from acceltrain import Hook, Run
from acceltrain.checkpoint.files import complete_checkpoints
from acceltrain.checkpoint.state import RunState
from acceltrain.hooks import TrainingLog
from acceltrain.train.run import RUN_PUBLIC

# 40 samples, batch 4, accumulate 3: 4 optimizer steps an epoch, 12 in all.
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
    "--no-progress",
    "--log-every",
    "2",
    "--eval-every",
    "2",
    "--num-workers",
    "0",
    "--report-to",
    "none",
]


def run_tiny(output_dir: Path, *args: str, hooks=()) -> int:
    return run_tiny_in_process(output_dir, *RUN, *args, hooks=hooks)


class KeepRun(Hook):
    def on_fit_end(self, run, summary):
        self.run = run


def test_the_public_attributes_of_a_run_are_the_documented_list_and_read_only(tmp_path):
    keep = KeepRun()
    assert run_tiny(tmp_path / "run", "--max-steps", "2", hooks=[keep]) == 0
    run = keep.run
    assert len(set(RUN_PUBLIC)) == len(RUN_PUBLIC)
    assert {name for name in dir(run) if not name.startswith("_")} == set(RUN_PUBLIC)
    assert all(name.startswith("_") for name in vars(run)), "nothing public is set on the instance"
    for name in RUN_PUBLIC:
        member = inspect.getattr_static(Run, name)
        if isinstance(member, property):
            with pytest.raises(AttributeError):
                setattr(run, name, None)
        else:
            assert inspect.isfunction(member), name


def test_a_checkpoint_holds_the_run_state_and_the_built_in_hooks_own_states(tmp_path):
    out = tmp_path / "run"
    assert run_tiny(out, "--stop-after-steps", "5", "--keep-best") == 75
    (checkpoint,) = [path for path in complete_checkpoints(out) if path.name == "step_00000005"]
    fields = json.loads((checkpoint / "trainer_state.json").read_text())
    assert list(fields) == [field.name for field in dataclasses.fields(RunState)]
    assert (fields["step"], fields["epoch"], fields["batch_in_epoch"]) == (5, 1, 3)
    assert fields["hooks"] == ["CheckpointSchedule", "Trackers"]
    best = json.loads((checkpoint / "hooks" / "CheckpointSchedule.json").read_text())["best_checkpoint"]
    assert best in {path.name for path in complete_checkpoints(out)}
    assert json.loads((checkpoint / "hooks" / "Trackers.json").read_text()) == {"run_id": None}


def test_the_summary_train_loss_does_not_need_the_training_log(tmp_path, monkeypatch):
    """The core closes the loss window itself: without the TrainingLog hook the summary reports the same
    loss as a run whose only training-log row is its last step's."""
    assert run_tiny(tmp_path / "logged", "--log-every", "1000") == 0
    builtin = acceltrain.train.loop.builtin_hooks
    monkeypatch.setattr(
        acceltrain.train.loop,
        "builtin_hooks",
        lambda cfg, **kwargs: [hook for hook in builtin(cfg, **kwargs) if not isinstance(hook, TrainingLog)],
    )
    assert run_tiny(tmp_path / "unlogged", "--log-every", "1000") == 0
    assert not [row for row in read_events(tmp_path / "unlogged") if "loss" in row]
    assert read_summary(tmp_path / "unlogged")["train_loss"] == read_summary(tmp_path / "logged")["train_loss"]


class FinishAt(Hook):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, run):
        if run.step == self.step:
            run.request_stop("enough", finish=True)


def test_an_early_finish_reports_the_loss_since_the_last_training_log_row(tmp_path):
    """Stopped at step 5 with rows every 2 steps: summary.json's train_loss is step 5's, as a run logging
    every step has it, not the step-4 row's."""
    assert run_tiny(tmp_path / "every", "--log-every", "1", hooks=[FinishAt(5)]) == 0
    assert run_tiny(tmp_path / "second", "--log-every", "2", hooks=[FinishAt(5)]) == 0
    row = {row["step"]: row["loss"] for row in read_events(tmp_path / "every") if "loss" in row}
    assert read_summary(tmp_path / "second")["train_loss"] == pytest.approx(row[5], rel=1e-6) != row[4]
