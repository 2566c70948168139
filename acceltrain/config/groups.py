"""The option group of each built-in hook, which the hook's ``from_config`` reads; free of torch and Accelerate, so
that a recipe's ``--help`` answers at once. :class:`acceltrain.TrainConfig` is the loop's own group and these."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from acceltrain.config.options import ConfigError, Options, flag_name, option, require

ReportTo = Literal["wandb", "tensorboard", "all", "none"]
WandbMode = Literal["online", "offline", "disabled"]


@dataclasses.dataclass
class EvaluationOptions(Options):
    """When to evaluate and on how much (``Evaluation``), and the metric that ends a run early
    (``TargetMetric``)."""

    eval_every: int | None = option(
        None, "evaluate every N optimizer steps; unset: at the end of each epoch and of the run", free_on_resume=True
    )
    eval_samples: int | None = option(
        None,
        "evaluate on a seeded random subset of N eval samples (stratified by label), the same on any number of "
        "processes; unset: all of them",
        free_on_resume=True,
    )
    target_metric: float | None = option(
        None,
        "finish as soon as the task's primary metric reaches this (accuracy: >=, loss: <=); records "
        "time_to_target_seconds",
        free_on_resume=True,
    )
    target_accuracy: float | None = option(
        None,
        "--target-metric for tasks whose primary metric is accuracy (classification), as a fraction",
        free_on_resume=True,
    )

    def validate(self) -> None:
        super().validate()
        if self.eval_every is not None:
            require(self.eval_every >= 1, "eval_every", self.eval_every, "an integer >= 1")
        if self.eval_samples is not None:
            require(self.eval_samples >= 1, "eval_samples", self.eval_samples, "an integer >= 1")
        if self.target_accuracy is not None:
            require(0 < self.target_accuracy <= 1, "target_accuracy", self.target_accuracy, "a fraction in (0, 1]")
            if self.target_metric is not None:
                raise ConfigError("give one of --target-metric and --target-accuracy, not both")
        if self.target_metric is not None:
            require(math.isfinite(self.target_metric), "target_metric", self.target_metric, "a finite number")


@dataclasses.dataclass
class EarlyStoppingOptions(Options):
    """``EarlyStopping``'s patience: evaluations without improvement of the task's primary metric
    before the run finishes."""

    early_stopping_patience: int | None = option(
        None,
        "finish after N evaluations in a row that do not improve the task's primary metric (accuracy: higher, loss: "
        "lower) by more than --early-stopping-threshold; the count survives --resume",
        free_on_resume=True,
    )
    early_stopping_threshold: float = option(
        0.0,
        "with --early-stopping-patience: the least change of the primary metric that counts as an improvement",
        free_on_resume=True,
    )

    def validate(self) -> None:
        super().validate()
        if self.early_stopping_patience is None:
            if self.early_stopping_threshold != 0.0:
                raise ConfigError(
                    "--early-stopping-threshold needs --early-stopping-patience (the evaluations to wait for an "
                    "improvement)"
                )
            return
        require(
            self.early_stopping_patience >= 1,
            "early_stopping_patience",
            self.early_stopping_patience,
            "an integer >= 1",
        )
        require(
            self.early_stopping_threshold >= 0,
            "early_stopping_threshold",
            self.early_stopping_threshold,
            "a number >= 0",
        )


@dataclasses.dataclass
class TimeBudgetOptions(Options):
    """``TimeBudget``'s wall-clock budget."""

    time_budget_minutes: float | None = option(
        None,
        "finish when the next step and the final evaluation would pass this much wall clock (from the first step, "
        "evaluations included); the LR schedule decays over the budget, or over --epochs/--max-steps when they end "
        "first",
    )

    def validate(self) -> None:
        super().validate()
        if self.time_budget_minutes is not None:
            require(self.time_budget_minutes > 0, "time_budget_minutes", self.time_budget_minutes, "a number > 0")


def parse_step_range(text: str) -> tuple[int, int]:
    """``"A:B"`` -> (A, B), optimizer steps counted from 1, A <= B; else ConfigError."""
    try:
        first, last = (int(part) for part in text.split(":"))
    except ValueError:
        first = last = -1
    if not 1 <= first <= last:
        raise ConfigError(f"--profile-steps {text!r} is invalid: must be A:B with 1 <= A <= B (optimizer steps)")
    return first, last


@dataclasses.dataclass
class ProfilingOptions(Options):
    """``Profiler``'s step range and ``MemoryReport``'s switch."""

    profile_steps: str | None = option(
        None,
        "A:B: torch.profiler over optimizer steps A..B, trace and top ops in <output_dir>/profile/",
        free_on_resume=True,
    )
    profile_with_stack: bool = option(
        False, "record Python stacks in the profile (slower, bigger trace)", free_on_resume=True
    )
    memory_report: bool = option(
        False,
        "print memory after model build, first forward, first backward, first optimizer step (memory.json)",
        free_on_resume=True,
    )

    def validate(self) -> None:
        super().validate()
        if self.profile_steps is not None:
            parse_step_range(self.profile_steps)


KEEP_LAST_WITH_BEST = 1  # --keep-last's default with --keep-best: the newest checkpoint, besides the best one


@dataclasses.dataclass
class CheckpointOptions(Options):
    """When to checkpoint and what to keep (``CheckpointSchedule``), and time slices (``Preemption``)."""

    save_every_steps: int | None = option(None, "save a checkpoint every N optimizer steps", free_on_resume=True)
    save_every_minutes: float | None = option(
        None, "save a checkpoint once N minutes have passed since the last one", free_on_resume=True
    )
    keep_last: int | None = option(
        None,
        f"keep only the newest N checkpoints that verify (and the best one with --keep-best); default: "
        f"{KEEP_LAST_WITH_BEST} with --keep-best (the best and the newest, which --resume auto continues from), "
        "else all",
        free_on_resume=True,
    )
    keep_best: bool = option(
        False, "checkpoint whenever the eval metric improves, and never delete the best checkpoint", free_on_resume=True
    )
    load_best_at_end: bool = option(
        False,
        "with --keep-best: the run folder's weights are the best evaluation's (its checkpoint), not the last "
        "step's, as Trainer's load_best_model_at_end; summary.json's weights_step says which",
        free_on_resume=True,
    )
    stop_after_steps: int | None = option(
        None,
        "checkpoint and stop after N optimizer steps of this launch (time-sliced jobs); continue with --resume auto",
        free_on_resume=True,
    )
    async_checkpoint: bool = option(
        False,
        "write checkpoints while training goes on: a save blocks only for a copy of the state in memory (DDP and "
        "FSDP; at most one save in flight; a checkpoint counts once complete; a stop waits for it)",
        free_on_resume=True,
    )

    def resolved(self) -> dict:
        """``keep_last`` unset: with ``--keep-best`` the best and the newest checkpoint (each improvement's
        checkpoint would stay otherwise: a full copy per gain), else all."""
        default = KEEP_LAST_WITH_BEST if self.keep_best else None
        return {**super().resolved(), "keep_last": default if self.keep_last is None else self.keep_last}

    def validate(self) -> None:
        super().validate()
        for name in ("save_every_steps", "keep_last", "stop_after_steps"):
            if getattr(self, name) is not None:
                require(getattr(self, name) >= 1, name, getattr(self, name), "an integer >= 1")
        if self.save_every_minutes is not None:
            require(self.save_every_minutes > 0, "save_every_minutes", self.save_every_minutes, "a number > 0")
        if self.load_best_at_end and not self.keep_best:
            raise ConfigError(
                "--load-best-at-end needs --keep-best: the best evaluation's checkpoint is the one it loads"
            )


@dataclasses.dataclass
class LoggingOptions(Options):
    """How often ``TrainingLog`` writes a row, and whether ``Console`` draws progress bars."""

    log_every: int = option(50, "log loss, lr and samples/s every N optimizer steps", free_on_resume=True)
    progress: bool | None = option(
        None,
        "progress bars on the main process: --progress always, --no-progress never (default: only when stderr is a "
        "terminal, so a log file gets no bar updates)",
        free_on_resume=True,
    )

    def validate(self) -> None:
        super().validate()
        require(self.log_every >= 1, "log_every", self.log_every, "an integer >= 1")


@dataclasses.dataclass
class PlotOptions(Options):
    """Whether ``Curves`` draws curves.png."""

    plots: bool = option(
        True,
        "draw <output_dir>/curves.png (loss and eval metric against step and seconds) when each launch ends",
        free_on_resume=True,
    )


@dataclasses.dataclass
class TrackingOptions(Options):
    """The trackers a run reports to (the ``Trackers`` hook) and the W&B run's settings."""

    report_to: ReportTo = option(
        "wandb", "experiment tracker: wandb, tensorboard, all (both) or none", free_on_resume=True
    )
    wandb_project: str | None = option(
        None,
        "W&B project (default: $WANDB_PROJECT, else 'acceltrain'); also TensorBoard's subfolder",
        free_on_resume=True,
    )
    run_name: str | None = option(None, "tracker run name (default: the output folder's name)", free_on_resume=True)
    wandb_group: str | None = option(None, "W&B group, e.g. to gather the runs of a sweep", free_on_resume=True)
    wandb_tags: str | None = option(
        None, "comma-separated W&B tags (a list in YAML)", free_on_resume=True, list_like=True
    )
    wandb_notes: str | None = option(None, "W&B run notes", free_on_resume=True)
    wandb_mode: WandbMode | None = option(
        None,
        "online, offline or disabled (default: $WANDB_MODE, else online with an API key, offline without)",
        free_on_resume=True,
    )
    log_model: bool = option(
        False,
        "upload the final model.safetensors as a W&B artifact (offline: kept for wandb sync)",
        free_on_resume=True,
    )


@dataclasses.dataclass
class HubOptions(Options):
    """``HubReady``'s upload to the Hugging Face Hub."""

    push_to_hub: bool = option(
        False,
        "upload the finished run folder (weights, config.json, model card, summary) to the Hub; token and repo checked "
        "before training",
        free_on_resume=True,
    )
    hub_model_id: str | None = option(
        None,
        "Hub repo for --push-to-hub, 'name' or 'namespace/name' (default: the output folder's name)",
        free_on_resume=True,
    )
    hub_private: bool = option(
        False,
        "with --push-to-hub: create the repo private (default: the namespace's default visibility)",
        free_on_resume=True,
    )

    def validate(self) -> None:
        super().validate()
        for name in ("hub_model_id", "hub_private"):
            if getattr(self, name) not in (None, False) and not self.push_to_hub:
                raise ConfigError(f"--{flag_name(name)} needs --push-to-hub")
