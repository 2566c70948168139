"""When to evaluate, and when a metric is good enough to stop."""

from __future__ import annotations

from accelerate.logging import get_logger

from acceltrain.config.groups import EvaluationOptions
from acceltrain.hooks.base import Hook

logger = get_logger(__name__)
# An evaluation batch (forward only) as a share of a training step, for the estimate before the first
# evaluation: a third in FLOPs, but 0.2-0.4 measured on a 2-core CPU (bf16), so planned with a half.
FORWARD_SHARE = 0.5


class Evaluation(Hook):
    """The evaluation schedule, in one place: every ``every`` optimizer steps, or at the end of each epoch
    when ``every`` is None, and always after the last step, also of a run that finishes early (a target
    reached, a time budget). What plans around evaluations asks it: how many are still to come
    (:meth:`left`, the console's ``+4 evals``) and how long one takes (:meth:`seconds`, the time budget's
    reserve). :meth:`acceltrain.Run.evaluate` runs one."""

    def __init__(self, every: int | None):
        self.every = every

    @classmethod
    def from_config(cls, cfg: EvaluationOptions, *, evaluates: bool) -> Evaluation | None:
        return cls(cfg.eval_every) if evaluates else None  # None: the run has no eval set

    def on_step_end(self, run) -> None:
        if (self.every and run.step % self.every == 0) or run.step == run.total_steps:
            run.evaluate()

    def on_epoch_end(self, run) -> None:
        if self.every is None and run.last_eval_step != run.step:  # the run's last step may have been evaluated
            run.evaluate()

    def on_train_end(self, run) -> None:
        if run.stop is not None and run.stop.finish and run.last_eval_step != run.step:
            run.evaluate()

    def left(self, run) -> int:
        """How many evaluations are still to come after this step, if the run goes to its last step."""
        if run.step >= run.total_steps:
            return 0
        every = self.every or -(-run.batches_per_epoch // run.cfg.grad_accum)  # an epoch's optimizer steps
        if not every:  # a stream's passes end when the stream does: count the final one
            return 1
        return run.total_steps // every - run.step // every + (run.total_steps % every != 0)

    def seconds(self, run, step_seconds: float) -> float:
        """One evaluation's duration: the last one's, else an estimate from a training step's seconds:
        ``FORWARD_SHARE`` of a step per evaluation batch (a forward pass without backward) and per view of
        the task's ``eval_views``."""
        if run.last_eval_seconds is not None:
            return run.last_eval_seconds
        views = getattr(run.task, "eval_views", 1)
        return len(run.eval_batches) * views * step_seconds / run.cfg.grad_accum * FORWARD_SHARE


class TargetMetric(Hook):
    """Finish the run as soon as the task's primary metric reaches ``target`` (at least it when higher is
    better, at most it otherwise); records ``time_to_target_seconds`` (wall clock from the first step,
    evaluation included) in the summary."""

    def __init__(self, target: float):
        self.target = target
        self.seconds: float | None = None

    @classmethod
    def from_config(cls, cfg: EvaluationOptions, evaluation: Evaluation | None) -> TargetMetric | None:
        # --target-accuracy is resolved into --target-metric before the hooks are built
        return cls(cfg.target_metric) if evaluation is not None and cfg.target_metric is not None else None

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
