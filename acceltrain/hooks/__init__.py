"""Hooks: optional behaviour as small objects the loop calls at named points (see :mod:`.base` for the
protocol and the order). Every flag-driven behaviour of ``fit()`` is one of the built-in hooks below."""

from __future__ import annotations

from .base import EVENTS, Hook, Hooks
from .checkpoint import CheckpointSchedule, Preemption
from .ema import EMA
from .evaluation import Evaluation, TargetMetric
from .hub import HubReady
from .logging import Console, MetricsFile, Trackers, TrainingLog
from .lookahead import Lookahead
from .plots import Curves
from .profiling import MemoryReport, Profiler
from .time_budget import TimeBudget

__all__ = [
    "EMA", "EVENTS", "CheckpointSchedule", "Console", "Curves", "Evaluation", "Hook", "Hooks", "HubReady", "Lookahead", "MemoryReport",
    "MetricsFile", "Preemption", "Profiler", "TargetMetric", "TimeBudget", "Trackers", "TrainingLog", "builtin_hooks",
]


def builtin_hooks(cfg, *, evaluates: bool, trackers: list[str], run_config: dict) -> list[Hook]:
    """The hooks the flags ask for, in the order they run at each event (after the user's): looking inside,
    the training log, evaluation and what reacts to it, checkpoints, preemption, then the writers of
    every logged row. ``CheckpointSchedule`` and ``Trackers`` are always there, so that their state (the
    best checkpoint, the W&B run id) goes on through a launch that does not use it."""
    hooks: list[Hook] = []
    if cfg.profile_steps:
        hooks.append(Profiler(cfg.profile_steps, cfg.profile_with_stack))
    if cfg.memory_report:
        hooks.append(MemoryReport())
    hooks.append(TrainingLog(cfg.log_every))
    evaluation = Evaluation(cfg.eval_every) if evaluates else None  # asked by the time budget and the console
    if evaluation:
        hooks.append(evaluation)
        if cfg.target_metric is not None:
            hooks.append(TargetMetric(cfg.target_metric))
    if cfg.time_budget_minutes is not None:
        hooks.append(TimeBudget(cfg.time_budget_minutes, evaluation))
    scheduled = bool(cfg.save_every_steps or cfg.save_every_minutes or cfg.keep_best or cfg.stop_after_steps)
    hooks.append(CheckpointSchedule(cfg.save_every_steps, cfg.save_every_minutes, cfg.keep_last, cfg.keep_best, save_at_end=scheduled))
    hooks.append(Preemption(cfg.stop_after_steps))
    hooks.append(MetricsFile())
    if cfg.plots:
        hooks.append(Curves())
    hooks.append(Trackers(trackers, run_config))
    hooks.append(Console(cfg.progress, evaluation))
    hooks.append(HubReady(push=cfg.push_to_hub))  # last: the model card and the upload see every summary entry
    from ..ray_train import RayReport, in_ray_worker

    if in_ray_worker():
        hooks.append(RayReport())
    return hooks
