"""``--time-budget-minutes``: the best model a wall-clock budget allows, never past it."""

from __future__ import annotations

import collections
import statistics

import torch

from acceltrain.config.groups import TimeBudgetOptions
from acceltrain.hooks.base import Hook
from acceltrain.hooks.evaluation import Evaluation

RECENT_STEPS = 21  # the step time is the median of these: robust to a stalled step on a shared machine


class TimeBudget(Hook):
    """Finish the run when one more optimizer step and the final evaluation would no longer fit in
    ``minutes`` of wall clock (counted from the first step, earlier launches and evaluations included),
    and plan the learning-rate schedule in elapsed time: after each step the schedule's progress is the
    elapsed fraction of the time left for training, so the decay ends at the budget (or at ``--epochs`` /
    ``--max-steps`` when those come first).

    It reads time from the run's clock alone, :meth:`~acceltrain.Run.elapsed` (what the logs and checkpoints
    record), steps' durations included, so its plan follows that clock (a test's fake one too). Every
    process decides from the main process's clock (one broadcast per step on several processes),
    so all stop at the same step with the same learning rate. The final evaluation's duration is what
    ``evaluation`` (the run's :class:`~acceltrain.hooks.Evaluation`; None: the run does not evaluate) says,
    and the last one measured is kept in checkpoints."""

    def __init__(self, minutes: float, evaluation: Evaluation | None = None):
        self.budget = minutes * 60.0
        self.evaluation = evaluation
        self.eval_seconds: float | None = None
        self._last_step_end: float | None = None  # run.elapsed() then
        self._evaluated = False  # since then: that interval was no training step
        self._recent_steps: collections.deque[float] = collections.deque(maxlen=RECENT_STEPS)

    @classmethod
    def from_config(cls, cfg: TimeBudgetOptions, evaluation: Evaluation | None) -> TimeBudget | None:
        return cls(cfg.time_budget_minutes, evaluation) if cfg.time_budget_minutes is not None else None

    def state_dict(self) -> dict:
        return {"eval_seconds": self.eval_seconds}

    def load_state_dict(self, state: dict) -> None:
        self.eval_seconds = state["eval_seconds"]

    def on_fit_start(self, run) -> None:
        # before the clock starts: the training time of earlier launches (0 for a fresh run), so that a
        # resumed run continues its schedule where it was
        self._plan(run, run.elapsed(), 0.0, self._final_eval_seconds(run, 0.0))

    def on_eval_end(self, run, metrics: dict) -> None:
        self.eval_seconds = run.last_eval_seconds
        self._evaluated = True

    def on_step_end(self, run) -> None:
        now = run.elapsed()
        if self._last_step_end is not None and not self._evaluated:
            self._recent_steps.append(now - self._last_step_end)
        self._restart_step_timer(now)
        self._decide(run)

    def on_epoch_end(self, run) -> None:
        """An epoch's end may evaluate after ``on_step_end``: decide again with that time spent, and time the
        next step from here."""
        self._restart_step_timer(run.elapsed())
        self._decide(run)

    def _restart_step_timer(self, now: float) -> None:
        self._last_step_end, self._evaluated = now, False

    def _decide(self, run) -> None:
        step_seconds = statistics.median(self._recent_steps) if self._recent_steps else 0.0  # one stall is no trend
        clock = [run.elapsed(), step_seconds, self._final_eval_seconds(run, step_seconds)]
        if run.accelerator.num_processes > 1:
            from accelerate.utils import broadcast

            clock = broadcast(torch.tensor(clock, dtype=torch.float64, device=run.accelerator.device)).tolist()
        if self._plan(run, *clock):
            run.request_stop(f"time budget of {self.budget / 60:g} min", finish=True)

    def _final_eval_seconds(self, run, step_seconds: float) -> float:
        if self.eval_seconds is not None or self.evaluation is None:  # measured (maybe by an earlier launch)
            return self.eval_seconds or 0.0
        return self.evaluation.seconds(run, step_seconds)

    def _plan(self, run, elapsed: float, step_seconds: float, reserve: float) -> bool:
        """Set the schedule's time progress; True when the next step and the final evaluation would not fit."""
        fraction = min(1.0, elapsed / max(self.budget - reserve, 1e-9))
        progress = run.schedule_progress  # never back: a shorter measured evaluation must not raise the lr again
        progress.time_fraction = max(progress.time_fraction, fraction)
        return elapsed + 2 * step_seconds + 1.1 * reserve >= self.budget  # margins for a slower step or evaluation
