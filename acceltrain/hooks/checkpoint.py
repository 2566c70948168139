"""When to checkpoint and what to keep, and stopping to be resumed (preemption signals, time slices)."""

from __future__ import annotations

import time

from acceltrain.checkpoint.files import checkpoint_dir, rotate_checkpoints
from acceltrain.config.groups import CheckpointOptions
from acceltrain.config.options import ConfigError
from acceltrain.hooks.base import Hook
from acceltrain.runtime.preemption import PreemptionSignals
from acceltrain.runtime.run_folder import CHECKPOINTS_DIR


class CheckpointSchedule(Hook):
    """A checkpoint every ``every_steps`` optimizer steps and/or once ``every_minutes`` have passed since the
    last one, whenever the primary metric improves (``keep_best``), and at the end of the run when
    ``save_at_end``; after every save only the newest ``keep_last`` that verify are kept (never the best
    one; a broken one never counts; unset, with ``keep_best``, the newest one: see
    :meth:`CheckpointOptions.resolved`). Always among the built-in hooks: its state, the best checkpoint's
    name, goes on through a launch that saves on no schedule."""

    def __init__(
        self,
        every_steps: int | None,
        every_minutes: float | None,
        keep_last: int | None,
        keep_best: bool,
        save_at_end: bool,
        load_best_at_end: bool = False,
    ):
        self.every_steps, self.every_minutes, self.keep_last, self.keep_best = (
            every_steps,
            every_minutes,
            keep_last,
            keep_best,
        )
        self.save_at_end, self.load_best_at_end = save_at_end, load_best_at_end
        self.best_checkpoint: str | None = (
            None  # the folder name of the best checkpoint (keep_best), never rotated away
        )

    @classmethod
    def from_config(cls, cfg: CheckpointOptions, *, evaluates: bool = True) -> CheckpointSchedule:
        if cfg.load_best_at_end and not evaluates:
            raise ConfigError(
                "--load-best-at-end keeps the best evaluation's weights, and this run has no eval set to "
                "evaluate on: give one, or drop the flag"
            )
        return cls(
            cfg.save_every_steps,
            cfg.save_every_minutes,
            cfg.resolved()["keep_last"],
            cfg.keep_best,
            save_at_end=saves_checkpoints(cfg),
            load_best_at_end=cfg.load_best_at_end,
        )

    def state_dict(self) -> dict:
        return {"best_checkpoint": self.best_checkpoint}

    def load_state_dict(self, state: dict) -> None:
        self.best_checkpoint = state["best_checkpoint"]

    def on_fit_start(self, run) -> None:
        self.last_save = time.monotonic()
        self.verified: set[str] = set()  # checkpoints known good: each is hashed at most once per run

    def on_step_end(self, run) -> None:
        if self.every_steps and run.step % self.every_steps == 0:
            run.request_save()
        if self.every_minutes and time.monotonic() - self.last_save >= self.every_minutes * 60:
            run.request_save()  # each process's own clock: the loop's agreement makes them save together

    def on_eval_end(self, run, metrics: dict) -> None:
        if self.keep_best and run.eval_improved:
            self.best_checkpoint = checkpoint_dir(run.output_dir, run.step).name
            run.request_save()

    def on_save(self, run, folder) -> None:
        self.last_save = time.monotonic()
        self.verified.add(folder.name)  # just written and hashed into its manifest
        if run.accelerator.is_main_process:
            rotate_checkpoints(run.output_dir, self.keep_last, self.best_checkpoint, self.verified)

    def on_train_end(self, run) -> None:
        if self.save_at_end:
            run.request_save()  # the final state, unless the last step was just saved
        finishing = run.stop is None or run.stop.finish  # not a stop to be resumed
        if self.load_best_at_end and finishing and self.best_checkpoint is not None:
            run.request_export(run.output_dir / CHECKPOINTS_DIR / self.best_checkpoint)

    def on_fit_end(self, run, summary: dict) -> None:
        if self.load_best_at_end and self.best_checkpoint is not None:
            summary["weights_step"] = int(self.best_checkpoint.removeprefix("step_"))


def saves_checkpoints(cfg: CheckpointOptions) -> bool:
    """Whether the run saves checkpoints on a schedule (then at its end too); a stop to be resumed always saves."""
    return bool(cfg.save_every_steps or cfg.save_every_minutes or cfg.keep_best or cfg.stop_after_steps)


def checkpoint_plan(cfg: CheckpointOptions) -> str:
    """When the run saves and what the rotation keeps, in a few words for the start-up log: "every 100 steps and at
    the end; keeps the best and the newest 1"."""
    if not saves_checkpoints(cfg):
        return "none scheduled (a stop to be resumed, by SIGTERM or Ctrl-C, saves one)"
    when = [
        *([f"every {cfg.save_every_steps} steps"] if cfg.save_every_steps else []),
        *([f"every {cfg.save_every_minutes:g} minutes"] if cfg.save_every_minutes else []),
        *(["at each better evaluation"] if cfg.keep_best else []),
        *([f"after step {cfg.stop_after_steps} (--stop-after-steps)"] if cfg.stop_after_steps else []),
    ]
    return f"{', '.join(when)} and at the end; {checkpoints_kept(cfg)}"


def checkpoints_kept(cfg: CheckpointOptions) -> str:
    """What the rotation keeps: "keeps the best and the newest 1", "keeps the newest 3", "keeps every checkpoint"."""
    newest = cfg.resolved()["keep_last"]
    if newest is None:
        return "keeps every checkpoint"
    return f"keeps the {'best and the ' if cfg.keep_best else ''}newest {newest}"


class Preemption(Hook):
    """SIGTERM and SIGUSR1 (what schedulers send before they kill a job), a first Ctrl-C, and
    ``--stop-after-steps`` (time slices): checkpoint at the next optimizer-step boundary and stop, to be
    resumed with ``--resume auto`` (exit 75; 130 after Ctrl-C)."""

    def __init__(self, stop_after_steps: int | None):
        self.stop_after_steps = stop_after_steps
        self.signals = PreemptionSignals()

    @classmethod
    def from_config(cls, cfg: CheckpointOptions) -> Preemption:
        return cls(cfg.stop_after_steps)

    def on_fit_start(self, run) -> None:
        self.signals.install()
        self.first_step = run.step

    def on_step_end(self, run) -> None:
        if self.signals.received is not None:
            run.request_stop(self.signals.name, exit_code=self.signals.exit_code)
        if self.stop_after_steps and run.step - self.first_step >= self.stop_after_steps:
            run.request_stop("stop_after_steps")

    def on_train_end(self, run) -> None:
        if run.stop is not None and not run.stop.finish:
            self.signals.ignore_further()  # on the way out: see PreemptionSignals.ignore_further

    def on_fit_end(self, run, summary: dict) -> None:
        self.signals.restore()

    def on_exception(self, run, error: Exception) -> None:
        self.signals.restore()
