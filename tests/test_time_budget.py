"""--time-budget-minutes: the run finishes inside the budget, its final evaluation included, with the
learning rate decayed over the budget; a resumed run continues the same budget and schedule.

The runs are timed by a fake clock (FakeClock), never the machine's: each decision follows exactly from
the seconds the clock is told a step and an evaluation take, however slow or loaded the machine."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from conftest import read_events, read_summary, run_tiny_in_process

from acceltrain import Hook
from acceltrain.train.optim import DECAYS

BUDGET = 60.0  # --time-budget-minutes 1
STEP, EVAL, EVAL_EVERY = 1.0, 2.0, 10  # fake seconds of an optimizer step and of an evaluation
# It stops once the next step and the final evaluation, with margins (2 steps, 1.1 evaluations: 4.2 s), no
# longer fit: after step 47 (and 4 evaluations) 55 s, after step 48 56 s; the final evaluation ends at 58 s.
LAST_STEP, FINAL_EVAL_ENDS = 48, 58.0


class FakeClock(Hook):
    """The run's clock (``Run.elapsed`` and ``Run.evaluate`` read acceltrain.train.state's ``time.perf_counter``),
    moved by this hook
    alone: a step takes ``step`` seconds (``stalls``: {step: seconds} for some), an evaluation ``evaluation``."""

    def __init__(
        self, monkeypatch, *, step: float = STEP, evaluation: float = EVAL, stalls: dict[int, float] | None = None
    ):
        self.now, self.step, self.evaluation, self.stalls = 0.0, step, evaluation, stalls or {}
        monkeypatch.setattr("acceltrain.train.state.time", SimpleNamespace(perf_counter=lambda: self.now))

    def on_step_start(self, run):
        self.now += self.stalls.get(run.step + 1, self.step)

    def on_eval_start(self, run):
        self.now += self.evaluation


def _run(output_dir, clock: FakeClock, *args: str, eval_every: int = EVAL_EVERY) -> int:
    return run_tiny_in_process(
        output_dir,
        "--batch-size",
        "8",
        "--epochs",
        "1000",
        "--log-every",
        "1",
        "--eval-every",
        str(eval_every),
        "--no-progress",
        "--num-workers",
        "0",
        "--report-to",
        "none",
        "--time-budget-minutes",
        str(BUDGET / 60),
        *args,
        hooks=[clock],
    )


def _assert_planned(output_dir) -> None:
    """The run of STEP-second steps and EVAL-second evaluations every EVAL_EVERY steps ends as planned, and
    its schedule's progress is the elapsed fraction of the time left for training (BUDGET - EVAL)."""
    summary, events = read_summary(output_dir), read_events(output_dir)
    evals = [event for event in events if "eval_accuracy" in event]
    assert summary["steps"] == evals[-1]["step"] == LAST_STEP, "the final model is evaluated, at the planned step"
    assert evals[-1]["wall_seconds"] == FINAL_EVAL_ENDS <= BUDGET, "the final evaluation ends inside the budget"
    lrs = {event["step"]: event["lr"] for event in events if "lr" in event}
    assert all(later <= earlier for earlier, later in itertools.pairwise(lrs.values()))
    ended = {event["step"]: event["wall_seconds"] for event in events}  # a step's last row: its evaluation's, if any
    # the lr of step n is set at step n-1 from the time after step n-2; from EVAL_EVERY on an evaluation is measured
    for step in range(EVAL_EVERY + 2, LAST_STEP + 1):
        fraction = ended[step - 2] / (BUDGET - EVAL)
        assert lrs[step] == pytest.approx(lrs[1] * DECAYS["cosine"](fraction)), f"step {step}"
    assert lrs[27] == pytest.approx(lrs[1] / 2), "half-way through the time (29 of 58 s), half-way down"


@pytest.mark.slow
def test_finishes_inside_the_budget_evaluated_at_its_last_step_with_the_schedule_decayed(tmp_path, monkeypatch):
    assert _run(tmp_path, FakeClock(monkeypatch)) == 0
    _assert_planned(tmp_path)


@pytest.mark.slow
def test_a_resumed_run_continues_the_budget_and_the_schedule(tmp_path, monkeypatch):
    clock = FakeClock(monkeypatch)
    assert _run(tmp_path, clock, "--stop-after-steps", "8") == 75
    first = {event["step"]: event["lr"] for event in read_events(tmp_path) if "lr" in event}
    assert max(first) == 8
    assert _run(tmp_path, clock, "--resume", "auto") == 0
    assert read_summary(tmp_path)["resumed_from_step"] == 8
    _assert_planned(tmp_path)  # the first launch's 8 s count: the same plan as without the stop
    resumed = {event["step"]: event["lr"] for event in read_events(tmp_path) if "lr" in event}
    assert resumed[9] == pytest.approx(first[8], rel=0.02) and resumed[9] < first[8], (
        "no restart of the schedule at its peak"
    )


def test_the_budget_is_validated():
    assert run_tiny_in_process(None, "--time-budget-minutes", "0") == 2


@pytest.mark.slow
@pytest.mark.parametrize(
    "clock, eval_every, last_step",
    [
        # a 20 s stall at step 5 (a shared machine): taken for the step time, it would end the run at once
        (
            dict(stalls={5: 20.0}),
            EVAL_EVERY,
            31,
        ),  # after step 30 (its evaluation included) 55 s, as after step 47 above
        # 5 s evaluations every 2 steps: taken for 6 s steps, it would stop at step 14
        (dict(evaluation=5.0), 2, 16),  # 16 steps and 8 evaluations: 56 s, + 2 steps + 5.5 s: past 60
    ],
)
def test_what_is_no_training_step_does_not_shorten_the_run(tmp_path, monkeypatch, clock, eval_every, last_step):
    """A step's time is the median of recent steps, an evaluation's time left out of them."""
    assert _run(tmp_path, FakeClock(monkeypatch, **clock), eval_every=eval_every) == 0
    summary = read_summary(tmp_path)
    assert summary["steps"] == last_step
    assert summary["wall_seconds"] <= BUDGET
