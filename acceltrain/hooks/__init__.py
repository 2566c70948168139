"""Hooks: optional behaviour as small objects the loop calls at named points (see :mod:`.base` for the
protocol and the order). Every flag-driven behaviour of ``fit()`` is one of the built-in hooks below."""

from __future__ import annotations

from acceltrain.hooks.base import EVENTS, Hook, Hooks
from acceltrain.hooks.checkpoint import CheckpointSchedule, Preemption
from acceltrain.hooks.early_stopping import EarlyStopping
from acceltrain.hooks.ema import EMA
from acceltrain.hooks.evaluation import Evaluation, TargetMetric
from acceltrain.hooks.hub import HubReady
from acceltrain.hooks.logging import Console, MetricsFile, Trackers, TrainingLog
from acceltrain.hooks.lookahead import Lookahead
from acceltrain.hooks.plots import Curves
from acceltrain.hooks.profiling import MemoryReport, Profiler
from acceltrain.hooks.pruning import SweepTrial
from acceltrain.hooks.time_budget import TimeBudget

__all__ = [
    "EMA",
    "EVENTS",
    "CheckpointSchedule",
    "Console",
    "Curves",
    "EarlyStopping",
    "Evaluation",
    "Hook",
    "Hooks",
    "HubReady",
    "Lookahead",
    "MemoryReport",
    "MetricsFile",
    "Preemption",
    "Profiler",
    "SweepTrial",
    "TargetMetric",
    "TimeBudget",
    "Trackers",
    "TrainingLog",
    "builtin_hooks",
]


def builtin_hooks(cfg, *, evaluates: bool, trackers: list[str], run_config: dict) -> list[Hook]:
    """The hooks the flags ask for, in the order they run at each event (after the user's): looking inside,
    the training log, evaluation and what reacts to it (a sweep's trial reporting to its study), checkpoints,
    preemption, then the writers of every logged row. Each is built by its own ``from_config`` from its option
    group (:mod:`acceltrain.config.options`). ``CheckpointSchedule`` and ``Trackers`` are always there, so that
    their state (the best checkpoint, the W&B run id) goes on through a launch that does not use it."""
    from acceltrain.hooks.ray_report import RayReport

    evaluation = Evaluation.from_config(cfg, evaluates=evaluates)  # asked by the time budget and the console
    hooks = [
        Profiler.from_config(cfg),
        MemoryReport.from_config(cfg),
        TrainingLog.from_config(cfg),
        evaluation,
        TargetMetric.from_config(cfg, evaluation),
        EarlyStopping.from_config(cfg, evaluation),
        TimeBudget.from_config(cfg, evaluation),
        SweepTrial.from_environment(),  # under `acceltrain sweep`: evaluations to the study, a pruned trial stopped
        CheckpointSchedule.from_config(cfg, evaluates=evaluates),
        Preemption.from_config(cfg),
        MetricsFile(),
        Curves.from_config(cfg),
        Trackers(trackers, run_config),
        Console.from_config(cfg, evaluation),
        HubReady.from_config(cfg),  # last: the model card and the upload see every summary entry
        RayReport() if RayReport.in_worker else None,
    ]
    return [hook for hook in hooks if hook is not None]
