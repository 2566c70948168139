"""Early stopping: finish a run whose evaluations have stopped improving."""

from __future__ import annotations

from accelerate.logging import get_logger

from acceltrain.config.groups import EarlyStoppingOptions
from acceltrain.config.options import ConfigError
from acceltrain.hooks.base import Hook
from acceltrain.hooks.evaluation import Evaluation

logger = get_logger(__name__)


class EarlyStopping(Hook):
    """Finish the run (``stop_reason`` in summary.json) once ``patience`` evaluations in a row have not improved the
    task's primary metric by more than ``threshold`` on the best evaluation before them (higher or lower, as the task
    says), as transformers' ``EarlyStoppingCallback``. The best evaluation is the loop's (``run.eval_improved``: any
    gain, the one ``--keep-best`` keeps), so a gain within the threshold still moves it: the stop names the weights
    kept. The best value, its step and the count are this hook's state, kept in every checkpoint: a resumed run goes
    on counting where it stopped (Composer's ``EarlyStopper`` starts again from zero)."""

    def __init__(self, patience: int, threshold: float, evaluation: Evaluation):
        self.patience, self.threshold, self.evaluation = patience, threshold, evaluation
        self.best: float | None = None
        self.best_step: int | None = None
        self.waited = 0  # evaluations since the last one that beat the best by more than the threshold

    @classmethod
    def from_config(cls, cfg: EarlyStoppingOptions, evaluation: Evaluation | None) -> EarlyStopping | None:
        if cfg.early_stopping_patience is None:
            return None
        if evaluation is None:
            patience = cfg.early_stopping_patience
            raise ConfigError(
                f"--early-stopping-patience {patience} counts evaluations, and this run has no eval set: "
                "give evaluation rows, or drop --early-stopping-patience"
            )
        return cls(cfg.early_stopping_patience, cfg.early_stopping_threshold, evaluation)

    def on_fit_start(self, run) -> None:
        evaluations = self.evaluation.left(run)
        if run.step == 0 and evaluations <= self.patience:
            every = self.evaluation.every
            schedule = f"every {every} steps" if every else "at the end of each epoch and of the run"
            raise ConfigError(
                f"--early-stopping-patience {self.patience} can never stop this run: it evaluates "
                f"{evaluations} time{'s' if evaluations != 1 else ''} ({schedule}), and stopping takes "
                f"{self.patience} evaluations after the best one: evaluate more often (--eval-every N) "
                "or lower the patience"
            )

    def on_eval_end(self, run, metrics: dict) -> None:
        name = f"eval_{run.task.primary_metric}"
        value = metrics[name]
        sign = 1 if run.task.higher_is_better else -1
        counts = not (run.eval_improved and (self.best is None or (value - self.best) * sign > self.threshold))
        if run.eval_improved:  # NaN never is
            self.best, self.best_step = value, run.step
        if not counts:
            self.waited = 0
            return
        self.waited += 1
        if self.waited >= self.patience:
            best = f"best {self.best:.4g} at step {self.best_step}" if self.best is not None else "no best yet"
            reason = (
                f"early stopping: {name} has not improved by more than {self.threshold:g} in {self.patience} "
                f"evaluations ({best})"
            )
            logger.info(reason)
            run.request_stop(reason, finish=True)

    def state_dict(self) -> dict:
        return {"best": self.best, "best_step": self.best_step, "waited": self.waited}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.best_step, self.waited = state["best"], state["best_step"], state["waited"]
