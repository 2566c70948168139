"""When to evaluate, and when a metric is good enough to stop."""

from __future__ import annotations

from accelerate.logging import get_logger

from .base import Hook

logger = get_logger(__name__)


class Evaluation(Hook):
    """Evaluate every ``every`` optimizer steps, or at the end of each epoch when ``every`` is None, and
    always after the last step, also of a run that finishes early (a target reached, a time budget)."""

    def __init__(self, every: int | None):
        self.every = every

    def on_step_end(self, run) -> None:
        if (self.every and run.step % self.every == 0) or run.step == run.total_steps:
            run.evaluate()

    def on_epoch_end(self, run) -> None:
        if self.every is None and run.last_eval_step != run.step:  # the run's last step may have been evaluated
            run.evaluate()

    def on_train_end(self, run) -> None:
        if run.stop is not None and run.stop.finish and run.last_eval_step != run.step:
            run.evaluate()


class TargetMetric(Hook):
    """Finish the run as soon as the task's primary metric reaches ``target`` (at least it when higher is
    better, at most it otherwise); records ``time_to_target_seconds`` (wall clock from the first step,
    evaluation included) in the summary."""

    def __init__(self, target: float):
        self.target = target
        self.seconds: float | None = None

    def on_eval_end(self, run, metrics: dict) -> None:
        name = f"eval_{run.task.primary_metric}"
        value = metrics[name]
        reached = value >= self.target if run.task.higher_is_better else value <= self.target
        if reached and self.seconds is None:
            self.seconds = run.elapsed()
            relation = ">=" if run.task.higher_is_better else "<="
            logger.info(f"reached {name} {value:.4f} {relation} {self.target} in {self.seconds:.1f} s")
            run.request_stop(f"{name} reached {self.target}", finish=True)

    def on_fit_end(self, run, summary: dict) -> None:
        summary["time_to_target_seconds"] = self.seconds
