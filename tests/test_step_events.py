"""The events around each optimizer step and epoch (``on_step_start``, ``on_before_optimizer_step``,
``on_epoch_end``) in their documented order, the gradient-norm example hook on one and two processes, and
why a run stopped (``stop_reason`` in summary.json and the ``done:`` line)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import (
    TINY_RECIPE,
    EventRecorder,
    check,
    docs_block,
    docs_example,
    launch,
    read_events,
    read_summary,
    run_tiny_in_process,
)

from acceltrain import Hook

# 40 samples, batch 4, accumulate 3: 10 batches an epoch in windows of 3, 3, 3 and 1, so 4 optimizer steps.
RUN = [
    "--num-train",
    "40",
    "--batch-size",
    "4",
    "--grad-accum",
    "3",
    "--epochs",
    "2",
    "--lr",
    "0.05",
    "--no-progress",
    "--log-every",
    "4",
    "--num-workers",
    "0",
    "--report-to",
    "none",
]

GRAD_NORM_EXAMPLE = docs_block("hooks.md", "class GradNorm")  # the docs' example, run as written


def grad_norm_hook(every: int):
    return docs_example("hooks.md", "class GradNorm")["GradNorm"](every)


def run_tiny(output_dir: Path, *args: str, hooks=()) -> int:
    return run_tiny_in_process(output_dir, *RUN, *args, hooks=hooks)


class Recorder(EventRecorder, Hook):
    """Every event with where the run stands at it; saves are test_hooks.py's."""

    def on_step_start(self, run):
        self.events.append(("step_start", run.step, run.batch_in_epoch))

    def on_before_optimizer_step(self, run):
        self.events.append(("before_optimizer_step", run.step, run.batch_in_epoch))

    def on_epoch_end(self, run):
        self.events.append(("epoch_end", run.epoch, run.step))

    def on_save(self, run, folder):
        pass


def steps(first: int, batches: list[tuple[int, int]]) -> list[tuple]:
    """Each optimizer step from ``first``: its start (first batch), before its optimizer step (last batch), end."""
    events = []
    for step, (start, last) in enumerate(batches, first):
        events += [("step_start", step - 1, start), ("before_optimizer_step", step - 1, last), ("step_end", step)]
    return events


WINDOWS = [(1, 3), (4, 6), (7, 9), (10, 10)]  # the batches of each step of an epoch, counted from 1


def test_the_events_come_in_the_documented_order_over_two_epochs_with_accumulation(tmp_path):
    """Evaluation at each epoch's end (no --eval-every) happens in on_epoch_end; the last step's, in its
    on_step_end, is not repeated."""
    recorder = Recorder()
    assert run_tiny(tmp_path / "run", hooks=[recorder]) == 0
    assert recorder.events == [
        ("fit_start", 0),
        ("epoch_start", 0),
        *steps(1, WINDOWS),
        ("log", 4, True),
        ("epoch_end", 0, 4),
        ("eval_start", 4),
        ("eval_end", 4),
        ("log", 4, False),
        ("epoch_start", 1),
        *steps(5, WINDOWS),
        ("log", 8, True),
        ("eval_start", 8),
        ("eval_end", 8),
        ("log", 8, False),
        ("epoch_end", 1, 8),
        ("train_end", 8),
        ("fit_end", 8),
    ]


def test_on_epoch_end_comes_before_the_steps_save_and_a_run_ending_mid_epoch_has_none_for_it(tmp_path):
    """A request made in on_epoch_end is agreed at that step: here a save of the epoch's last step."""

    class SaveAtEpochEnd(Recorder):
        def on_epoch_end(self, run):
            super().on_epoch_end(run)
            run.request_save()

        def on_save(self, run, folder):
            self.events.append(("save", Path(folder).name))

    recorder = SaveAtEpochEnd()
    assert run_tiny(tmp_path / "run", "--max-steps", "6", "--eval-every", "100", hooks=[recorder]) == 0
    ends = [event for event in recorder.events if event[0] in ("epoch_end", "save", "step_start")]
    assert ends[3:6] == [("step_start", 3, 10), ("epoch_end", 0, 4), ("save", "step_00000004")]
    assert [event for event in ends if event[0] == "epoch_end"] == [("epoch_end", 0, 4)], (
        "step 6 is in the middle of epoch 1"
    )


def test_the_gradient_norm_example_runs_as_written_and_sees_the_clipped_gradients(tmp_path):
    """With --max-grad-norm the hook runs after clipping: its norm is the clipped one, run.grad_norm the norm before."""
    out = tmp_path / "run"
    assert run_tiny(out, "--max-grad-norm", "1e9", hooks=[grad_norm_hook(2)]) == 0
    rows = read_events(out)
    norms = {row["step"]: row["grad_l2"] for row in rows if "grad_l2" in row}
    assert sorted(norms) == [2, 4, 6, 8] and all(math.isfinite(v) and v > 0 for v in norms.values())
    clipped_at = {
        row["step"]: row["grad_norm"] for row in rows if "grad_norm" in row
    }  # the training log's, steps 4 and 8
    assert clipped_at and all(norms[step] == pytest.approx(clipped_at[step], rel=1e-5) for step in clipped_at)

    class ClippedNorms(Hook):
        seen: list = []

        def on_before_optimizer_step(self, run):
            norm = sum(p.grad.norm() ** 2 for p in run.model.parameters() if p.grad is not None) ** 0.5
            self.seen.append((norm.item(), float(run.grad_norm)))

    assert run_tiny(tmp_path / "clipped", "--max-steps", "3", "--max-grad-norm", "0.01", hooks=[ClippedNorms()]) == 0
    assert len(ClippedNorms.seen) == 3
    assert all(after == pytest.approx(0.01, rel=1e-3) and before > 0.01 for after, before in ClippedNorms.seen)


# A recipe as a user launches it: the tiny recipe with the example hook, and a recorder of the rows every
# process logs (metrics.jsonl holds the main process's alone).
TWO_PROCESS_SCRIPT = """\
import json, os, sys
sys.path.insert(0, {helpers!r})
import tiny_recipe
from acceltrain import Hook, run_recipe
{example}

class RowsOfThisProcess(Hook):
    def __init__(self):
        self.norms = {{}}

    def on_log(self, run, metrics):
        if "grad_l2" in metrics:
            self.norms[metrics["step"]] = metrics["grad_l2"]

    def on_fit_end(self, run, summary):
        (run.output_dir / f"norms{{os.environ.get('RANK', '0')}}.json").write_text(json.dumps(self.norms))

run_recipe(lambda cfg: tiny_recipe.main(cfg, hooks=[GradNorm(1), RowsOfThisProcess()]), tiny_recipe.TinyConfig)
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_gradient_norm_example_sees_synchronised_gradients_on_two_processes(tmp_path):
    """Both processes see the same norm at every step, that of one process at the whole batch: the
    gradients are all-reduced (averaged) before the event."""
    script = tmp_path / "grad_norm_recipe.py"
    script.write_text(TWO_PROCESS_SCRIPT.format(helpers=str(TINY_RECIPE.parent), example=GRAD_NORM_EXAMPLE))
    common = [
        "--num-train",
        "64",
        "--grad-accum",
        "2",
        "--max-steps",
        "4",
        "--lr",
        "0.05",
        "--no-progress",
        "--num-workers",
        "0",
        "--report-to",
        "none",
    ]
    check(
        launch(
            script,
            [*common, "--batch-size", "4", "--output-dir", str(tmp_path / "ddp")],
            processes=2,
            launcher="accelerate",
        )
    )
    check(launch(script, [*common, "--batch-size", "8", "--output-dir", str(tmp_path / "single")]))
    rank0, rank1 = (json.loads((tmp_path / "ddp" / f"norms{rank}.json").read_text()) for rank in (0, 1))
    assert list(rank0) == ["1", "2", "3", "4"] and rank0 == rank1
    single = json.loads((tmp_path / "single" / "norms0.json").read_text())
    assert all(rank0[step] == pytest.approx(single[step], rel=1e-4) for step in single)
    assert {row["step"]: row["grad_l2"] for row in read_events(tmp_path / "ddp") if "grad_l2" in row} == {
        int(k): v for k, v in rank0.items()
    }


@pytest.mark.gpu
def test_under_fp16_the_event_sees_unscaled_gradients(tmp_path):
    """Without --max-grad-norm the loop unscales them itself: the norm is the one clipping measures, not
    the grad scaler's 65536 times it."""
    common = ["--mixed-precision", "fp16", "--max-steps", "2"]
    assert run_tiny(tmp_path / "plain", *common, hooks=[grad_norm_hook(1)]) == 0
    assert (
        run_tiny(tmp_path / "clipped", *common, "--max-grad-norm", "1e9", "--log-every", "1", hooks=[grad_norm_hook(1)])
        == 0
    )
    plain = [row["grad_l2"] for row in read_events(tmp_path / "plain") if "grad_l2" in row]
    clipped = [row for row in read_events(tmp_path / "clipped") if "grad_norm" in row]
    assert read_summary(tmp_path / "plain")["mixed_precision"] == "fp16"
    assert plain[0] == pytest.approx(clipped[0]["grad_norm"], rel=1e-3) and plain[0] < 100


class StopAt(Hook):
    def __init__(self, step: int, finish: bool):
        self.step, self.finish = step, finish

    def on_step_end(self, run):
        if run.step == self.step:
            run.request_stop("enough", finish=self.finish)


@pytest.mark.parametrize(
    ("args", "hooks", "steps", "reason"),
    [
        ((), (), 8, None),
        ((), (StopAt(5, finish=True),), 5, "enough"),
        (("--eval-every", "2", "--target-metric", "0"), (), 2, "eval_accuracy reached 0.0"),
        (("--time-budget-minutes", "1e-07"), (), 1, "time budget of 1e-07 min"),  # 6 us: over after any first step
    ],
    ids=["to-the-end", "a-hook", "target", "time-budget"],
)
def test_why_a_run_stopped_is_in_the_summary_and_the_done_line(tmp_path, capsys, args, hooks, steps, reason):
    out = tmp_path / "run"
    assert run_tiny(out, *args, hooks=hooks) == 0
    summary = read_summary(out)
    assert (summary["steps"], summary["stop_reason"]) == (steps, reason)
    (done,) = [line[line.index("done: ") :] for line in capsys.readouterr().out.splitlines() if "done: " in line]
    assert done.startswith(
        f"done: {steps} steps (stopped: {reason}), train loss " if reason else f"done: {steps} steps, train loss "
    )


def test_a_stop_to_be_resumed_says_why_and_the_run_resumed_to_its_end_has_no_stop_reason(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_tiny(out, "--stop-after-steps", "3") == 75
    assert "stopped at step 3 (stop_after_steps); checkpoint saved" in capsys.readouterr().out
    assert not (out / "summary.json").exists()
    assert run_tiny(out, "--resume", "auto") == 0
    assert read_summary(out)["stop_reason"] is None
