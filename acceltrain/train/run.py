"""The run as hooks see it: one read-only view of what training is made of and where it stands, and the few
things a hook may ask for (``request_save``, ``request_stop``, ``request_export``, ``log``, ``evaluate``,
``paused``). It reads the prepared pieces and the loop's :class:`~acceltrain.train.state.TrainState`, and changes
them only through the state's named methods; what survives a resume is the state's
:class:`~acceltrain.checkpoint.RunState` (a checkpoint's trainer_state.json) and each hook's own ``state_dict()``.
"""

from __future__ import annotations

import operator
from pathlib import Path

import torch

from acceltrain.runtime.logs import show_progress
from acceltrain.runtime.preemption import EXIT_PREEMPTED, Stop


def _view(path: str, doc: str) -> property:
    """A read-only attribute: hooks read it, the loop alone changes it."""
    return property(operator.attrgetter(path), doc=doc)


class Run:
    """What every hook gets. Its public attributes are :data:`RUN_PUBLIC`, all read-only."""

    # what the run is made of, fixed before the first step
    cfg = _view("_cfg", "the resolved TrainConfig")
    accelerator = _view("_prepared.accelerator", "Accelerate's Accelerator")
    engine = _view("_prepared.engine", "the engine the run runs on (acceltrain.engines)")
    model = _view(
        "_prepared.model",
        "the prepared model as Accelerate wrapped it (DDP, FSDP, DeepSpeed, compiled); its own "
        "modules and parameter names: ``run.accelerator.unwrap_model(run.model)``",
    )
    optimizer = _view("_prepared.optimizer", "the prepared optimizer (its ``.optimizer``: the torch optimizer)")
    scheduler = _view("_prepared.scheduler", "the LR scheduler, stepped once per optimizer step on every process")
    schedule_progress = _view(
        "_prepared.schedule_progress", "the LR schedule's progress by another measure than steps (a time budget)"
    )
    task = _view("_task", "the task: batches into losses and eval values")
    eval_batches = _view("_prepared.eval_batches", "the prepared eval loader, or None")
    output_dir = _view("_output_dir", "the run folder (a Path)")
    runtime = _view("_prepared.runtime", "versions, device, process count and sizes, as in summary.json")
    total_steps = _view("_state.total_steps", "the optimizer steps the run trains for")
    batches_per_epoch = _view("_state.batches_per_epoch", "the per-process batches of one epoch")
    train_samples = _view("_state.train_samples", "the training set's size")
    flops_per_sample = _view(
        "_prepared.flops_per_sample", "model FLOPs of one training sample (forward and backward), or None"
    )
    peak_flops = _view("_prepared.peak_flops", "the peak FLOP/s of one device, or None")
    # where it stands: its RunState
    step = _view("_state.run_state.step", "optimizer steps done")
    epoch = _view("_state.run_state.epoch", "the epoch being trained, counted from 0")
    batch_in_epoch = _view(
        "_state.run_state.batch_in_epoch",
        "per-process batches of this epoch trained on (in a step: the current one's, from 1)",
    )
    samples_seen = _view("_state.run_state.samples_seen", "training samples seen by all processes")
    best_metric = _view("_state.run_state.best_metric", "the best primary eval metric so far, or None")
    last_eval = _view("_state.run_state.last_eval", "the latest evaluation's metrics ({} before the first)")
    epoch_progress = _view("_state.epoch_progress", "epochs done, fractional: 1.5 is the middle of the second epoch")
    # what this launch measured
    lr = _view(
        "_state.lr",
        "the learning rate of the latest optimizer step (in on_before_optimizer_step: of the coming one)",
    )
    grad_norm = _view(
        "_state.grad_norm", "with --max-grad-norm: that step's gradient norm before clipping (a tensor); else None"
    )
    skipped_steps = _view("_state.skipped_steps", "optimizer steps skipped: an fp16 overflow, a quorum not committed")
    train_loss = _view(
        "_state.train_loss", "the mean training loss of the latest closed window (see take_train_loss), or None"
    )
    eval_improved = _view(
        "_state.eval_improved", "whether the latest evaluation's primary metric is strictly better than any before"
    )
    last_eval_step = _view("_state.last_eval_step", "the step of this launch's latest evaluation, or None")
    last_eval_started = _view("_state.last_eval_started", "time.perf_counter() when it started (0.0 before the first)")
    last_eval_seconds = _view("_state.last_eval_seconds", "how long it took, or None")
    launch_started = _view("_state.launch_started", "time.perf_counter() when this launch's first step started")
    throughput = _view(
        "_state.throughput", "this launch's speed meter (window(), totals()); None before the first step"
    )
    stop = _view("_state.stop", "why training ended early (a Stop: reason, finish), else None")

    def __init__(self, prepared, task, state, hooks):
        self._prepared, self._task, self._state, self._hooks = prepared, task, state, hooks
        self._cfg = prepared.cfg.read_only()
        self._output_dir = Path(prepared.cfg.output_dir)

    # ---- asked for by hooks

    def request_save(self) -> None:
        """Checkpoint after this optimizer step (at the end of the run when asked from ``on_train_end``)."""
        self._state.request_save()

    def request_stop(self, reason: str, *, finish: bool = False, exit_code: int = EXIT_PREEMPTED) -> None:
        """End training after this optimizer step: as a finished run (``finish=True``; ``reason`` becomes
        summary.json's ``stop_reason``) or checkpointed to be resumed (the process then exits with
        ``exit_code``). A stop asked for on the last step simply finishes the run."""
        self._state.request_stop(Stop(reason, finish, exit_code))

    def request_export(self, weights: dict | Path) -> None:
        """Write ``weights`` (a state dict of the unwrapped model's names) as model.safetensors instead of the
        model's own, e.g. an average (EMA), or the model of checkpoint folder ``weights`` (the best one); ask in
        ``on_train_end``."""
        self._state.request_export(weights)

    def attach(self, path: Path) -> None:
        """Attach the file at ``path`` to the tracker run when the run finishes (W&B; a profile's trace)."""
        self._state.attach(Path(path))

    @property
    def attached_files(self) -> tuple[Path, ...]:
        """The files :meth:`attach` was given, in order."""
        return tuple(self._state.attached)

    def log(self, metrics: dict) -> None:
        """Write one row (it needs ``"step"``): hooks may add to it, then metrics.jsonl, trackers, progress bar."""
        self._hooks.call("on_log", self, metrics)

    def paused(self):
        """A context: time inside is left out of the throughput figures (evaluation, checkpointing). Before the
        clock starts (an evaluation in ``on_fit_start``) there is nothing to pause."""
        return self._state.paused()

    def evaluate(self) -> dict:
        """Evaluate now (every process), keep the result and the best primary metric, log it."""
        with self.paused():
            self._state.eval_started()
            self._hooks.call("on_eval_start", self)
            metrics, samples = evaluate(
                self.accelerator, self.model, self.eval_batches, self._task, progress=self._cfg.progress
            )
            self.model.train()
            self._state.record_eval(metrics, self._task.primary_metric, self._task.higher_is_better)
            self._hooks.call("on_eval_end", self, metrics)
            self.log({"step": self.step, **metrics, "eval_samples": samples, "wall_seconds": round(self.elapsed(), 3)})
        return metrics

    def take_train_loss(self) -> float:
        """The mean training loss since the window was last closed, over all processes (a collective); it
        becomes ``train_loss``. The training log closes it at each row; the run closes the rest at its end."""
        return self._state.take_train_loss()

    def elapsed(self) -> float:
        """Wall-clock seconds since the run's first step, earlier launches included (before this launch's
        first step: those of the earlier launches)."""
        return self._state.elapsed()


# Run's public attributes, all read-only (tested against a real run): the list the docs give.
RUN_PUBLIC = (
    # what the run is made of
    "cfg",
    "accelerator",
    "engine",
    "model",
    "optimizer",
    "scheduler",
    "schedule_progress",
    "task",
    "eval_batches",
    "output_dir",
    "runtime",
    "total_steps",
    "batches_per_epoch",
    "train_samples",
    "flops_per_sample",
    "peak_flops",
    # where it stands (its RunState)
    "step",
    "epoch",
    "batch_in_epoch",
    "samples_seen",
    "best_metric",
    "last_eval",
    "epoch_progress",
    # what this launch measured
    "lr",
    "grad_norm",
    "skipped_steps",
    "train_loss",
    "eval_improved",
    "last_eval_step",
    "last_eval_started",
    "last_eval_seconds",
    "launch_started",
    "throughput",
    "stop",
    "attached_files",
    "elapsed",
    # what a hook may ask for
    "request_save",
    "request_stop",
    "request_export",
    "attach",
    "log",
    "evaluate",
    "paused",
    "take_train_loss",
)


def evaluate(accelerator, model, batches, task, *, progress: bool | None = False) -> tuple[dict[str, float], int]:
    """Each per-sample eval value summed over the whole eval set, exact across processes
    (``gather_for_metrics`` drops the samples that even batches padded onto the last one), then turned
    into metrics by ``task.eval_metrics(sums, samples)`` if the task has it, else into means. ``progress``:
    a tqdm bar over the batches on the main process, gone when done (an evaluation can take a minute)."""
    from tqdm.auto import tqdm

    model.eval()
    totals: dict[str, torch.Tensor] = {}
    count = 0
    with torch.no_grad():
        for batch in tqdm(
            batches,
            desc="eval",
            unit="batch",
            leave=False,
            dynamic_ncols=True,
            disable=not (show_progress(progress) and accelerator.is_main_process),
        ):
            values = accelerator.gather_for_metrics(task.eval_values(model, batch))
            for key, value in values.items():
                totals[key] = totals.get(key, 0) + value.double().sum()
            count += len(next(iter(values.values())))
    sums = {key: total.item() for key, total in totals.items()}
    summarise = getattr(task, "eval_metrics", None)
    metrics = summarise(sums, count) if summarise else {key: total / count for key, total in sums.items()}
    return {f"eval_{key}": value for key, value in metrics.items()}, count
