"""The trial's side of ``acceltrain sweep``: each evaluation reported to the Optuna study, and a trial the pruner
gives up on finished at that step as an ordinary stop (``stop_reason`` "pruned"), on every process at once.

The sweep names the study, its storage and the trial in the environment variable :data:`SWEEP_ENV` (JSON), and
:func:`acceltrain.hooks.builtin_hooks` adds :class:`SweepTrial` when it is set: the recipe is not changed. The same
variable with ``{"probe": FILE}`` makes a launch a probe instead: before any trial, the sweep learns the task's
primary metric and the names of the eval metrics (one eval batch), then the launch stops as bad input would, leaving
nothing in its folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

from accelerate.logging import get_logger

from acceltrain.config.options import ConfigError, first_line
from acceltrain.hooks.base import Hook

logger = get_logger(__name__)

SWEEP_ENV = "ACCELTRAIN_SWEEP_TRIAL"
JOURNAL_PREFIX = "journal:"  # a storage spec naming a journal file, else an RDB URL
PRUNERS = ("median", "hyperband", "none")
PROBE_DONE = "the sweep's probe has what it asked for"  # the probe's stop: not bad input (the sweep reads its file)


def open_storage(spec: str):
    """The Optuna storage of ``spec``: ``journal:PATH`` (the study folder's own journal file) or an RDB URL
    (``sqlite:///FILE``, ``postgresql://...``) that several workers share. A URL that cannot be opened is one line."""
    import optuna

    if spec.startswith(JOURNAL_PREFIX):
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        return JournalStorage(JournalFileBackend(spec[len(JOURNAL_PREFIX) :]))
    try:
        return optuna.storages.RDBStorage(spec, engine_kwargs=_engine_kwargs(spec))
    except Exception as err:  # noqa: BLE001 - SQLAlchemy's and the drivers' errors: a URL that cannot be reached
        raise unreachable(spec, err) from None


def check_reachable(url: str) -> None:
    """One connection to ``url``, nothing created in it: a URL that cannot be reached is one line before anything is
    written, and the tables are made later, by one worker at a time (two at once can collide on SQLite)."""
    try:
        from sqlalchemy import create_engine

        engine = create_engine(url, **_engine_kwargs(url))
        try:
            with engine.connect():
                pass
        finally:
            engine.dispose()
    except Exception as err:  # noqa: BLE001 - as above
        raise unreachable(url, err) from None


def unreachable(url: str, err: Exception) -> ConfigError:
    return ConfigError(
        f"--storage {shown_url(url)!r} cannot be reached: {first_line(err)} (give an Optuna RDB URL every worker "
        "reaches, e.g. sqlite:///PATH/study.db or postgresql://user@host/db, or leave --storage out for a journal "
        "file in --study-dir)"
    )


def _engine_kwargs(url: str) -> dict:
    """SQLite waits for a lock another worker holds (its default, 5 s, fails under a few concurrent writers)."""
    return {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}


def shown_url(spec: str) -> str:
    """A storage spec as it may be printed and written: a URL's password hidden."""
    if spec.startswith(JOURNAL_PREFIX):
        return spec
    try:
        from sqlalchemy.engine import make_url

        return make_url(spec).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a URL SQLAlchemy reads: shown as given, it has no password to hide
        return spec


def make_pruner(name: str):
    """Optuna's pruner for ``--pruner``: the median rule (after 5 trials), Hyperband, or none."""
    import optuna

    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=5, n_warmup_steps=0)
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner()
    return optuna.pruners.NopPruner()


class SweepTrial(Hook):
    """Reports each evaluation's ``metric`` to the study as the trial's intermediate value at that step, and stops
    the run as finished (``stop_reason`` "pruned") when the pruner says so. The main process alone talks to the
    storage and decides; the decision is broadcast, so that every process stops at the same step."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.metric = spec.get("metric")
        self.trial = None

    @classmethod
    def from_environment(cls) -> SweepTrial | None:
        raw = os.environ.get(SWEEP_ENV)
        return cls(json.loads(raw)) if raw else None

    def on_fit_start(self, run) -> None:
        if "probe" in self.spec:
            self._probe(run)
        if run.accelerator.is_main_process:
            import optuna

            optuna.logging.set_verbosity(optuna.logging.WARNING)
            study = optuna.load_study(
                study_name=self.spec["study"],
                storage=open_storage(self.spec["storage"]),
                pruner=make_pruner(self.spec["pruner"]),
            )
            self.trial = optuna.trial.Trial(study, self.spec["trial_id"])

    def _probe(self, run) -> None:
        """What the sweep must know before any trial: the task's primary metric and its direction, and the eval
        metrics this recipe logs (from one eval batch: their names, not their values)."""
        names = []
        if run.eval_batches is not None:
            import torch

            run.model.eval()
            with torch.no_grad():
                values = run.task.eval_values(run.model, next(iter(run.eval_batches)))
            run.model.train()
            sums = {key: float(value.double().sum()) for key, value in values.items()}
            count = len(next(iter(values.values())))
            summarise = getattr(run.task, "eval_metrics", None)
            names = [f"eval_{key}" for key in (summarise(sums, count) if summarise else sums)]
        if run.accelerator.is_main_process:
            found = {
                "primary_metric": f"eval_{run.task.primary_metric}" if names else None,
                "higher_is_better": bool(getattr(run.task, "higher_is_better", False)),
                "eval_metrics": names,
            }
            Path(self.spec["probe"]).write_text(json.dumps(found))
        raise ConfigError(PROBE_DONE)  # bad input's way out: the folder is left as found

    def on_eval_end(self, run, metrics: dict) -> None:
        prune = [False]
        if self.trial is not None:
            value = metrics.get(self.metric)
            if value is not None and value == value:  # NaN: nothing to compare, the trial goes on
                self.trial.report(float(value), run.step)
                prune[0] = self.trial.should_prune()
        if run.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(prune, from_process=0)
        if prune[0] and run.step < run.total_steps:  # at the last step the trial is complete
            logger.info(f"pruned by the sweep at step {run.step}: {self.metric} {metrics.get(self.metric)}")
            run.request_stop("pruned", finish=True)
