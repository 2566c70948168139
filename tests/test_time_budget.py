"""--time-budget-minutes: the run finishes inside the budget, its final evaluation included, with the
learning rate decayed over the budget; a resumed run continues the same budget and schedule."""

from __future__ import annotations

import time

import pytest

from conftest import read_events, read_summary, run_tiny_in_process

BUDGET_MINUTES = 0.08  # 4.8 s of training at 0.05 s a step: about 90 steps idle, enough margin on a loaded machine
SLOW = ["--batch-size", "8", "--sleep-per-step", "0.05", "--epochs", "1000", "--log-every", "1", "--eval-every", "10", "--no-progress",
        "--num-workers", "0", "--report-to", "none", "--time-budget-minutes", str(BUDGET_MINUTES)]


def _lrs(events) -> dict[int, float]:
    return {event["step"]: event["lr"] for event in events if "lr" in event}


def test_finishes_inside_the_budget_evaluated_at_its_last_step_with_the_schedule_decayed(tmp_path):
    assert run_tiny_in_process(tmp_path, *SLOW) == 0
    summary, events = read_summary(tmp_path), read_events(tmp_path)
    evals = [event for event in events if "eval_accuracy" in event]
    assert evals[-1]["step"] == summary["steps"] < 1000, "the final model is evaluated"
    # planned from measured durations: on a loaded machine the final evaluation may run a little slower than
    # the last one (CI: 4.814 s of 4.8), so a quarter of a second (two steps here) of slack
    assert evals[-1]["wall_seconds"] <= BUDGET_MINUTES * 60 + 0.25, "the final evaluation ends inside the budget"
    assert summary["steps"] >= 10
    lrs = _lrs(events)
    rows = [event for event in events if "lr" in event]  # half-way in time: on a loaded machine steps vary in length
    middle = min(rows, key=lambda event: abs(event["wall_seconds"] - evals[-1]["wall_seconds"] / 2))["lr"]
    assert 0.2 * lrs[1] < middle < 0.8 * lrs[1], "half-way through the budget the cosine is half-way down (it was 0 from step 2 on)"
    assert lrs[summary["steps"]] < 0.25 * lrs[1], "the cosine decay follows the elapsed time, not the 1000 epochs"
    assert all(later <= earlier + 1e-12 for earlier, later in zip(list(lrs.values()), list(lrs.values())[1:]))


def test_a_resumed_run_continues_the_budget_and_the_schedule(tmp_path):
    assert run_tiny_in_process(tmp_path, *SLOW, "--stop-after-steps", "8") == 75
    first = _lrs(read_events(tmp_path))
    assert max(first) == 8
    assert run_tiny_in_process(tmp_path, *SLOW, "--resume", "auto") == 0
    summary = read_summary(tmp_path)
    assert summary["resumed_from_step"] == 8
    assert summary["wall_seconds"] <= BUDGET_MINUTES * 60, "the first launch's training time counts"
    lrs = _lrs(read_events(tmp_path))
    assert first[8] > 0.3 * first[1], "a third of the budget in, the lr is still high"
    assert lrs[9] <= first[8] and lrs[9] == pytest.approx(first[8], rel=0.2), "no restart of the schedule at its peak"


def test_the_budget_is_validated():
    assert run_tiny_in_process(None, "--time-budget-minutes", "0") == 2


class OneSlowStep:
    """Step 5 takes two seconds (a stall on a shared machine): the budget must not take it for the norm."""

    def on_step_end(self, run):
        if run.step == 5:
            time.sleep(2.0)


def test_one_slow_step_does_not_end_the_run_early(tmp_path):
    args = [arg if arg != str(BUDGET_MINUTES) else "0.12" for arg in SLOW]  # 7.2 s
    assert run_tiny_in_process(tmp_path, *args, hooks=[OneSlowStep()]) == 0
    ended = [e for e in read_events(tmp_path) if "eval_accuracy" in e][-1]["wall_seconds"]
    assert ended >= 0.6 * 7.2, "a single stalled step made the budget stop at once (at about 2.5 s)"
    assert ended <= 7.2 * 1.1  # the final evaluation's own duration varies with the load of a shared machine
