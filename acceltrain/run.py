"""The run: one object that holds what training is made of and where it stands, handed to every hook.

Hooks read it (``run.step``, ``run.epoch``, ``run.model``, ``run.last_eval``, ``run.cfg``, ...) and ask
it for things (``request_save``, ``request_stop``, ``request_export``, ``log``, ``evaluate``, ``paused``);
they never write it. One rule says what survives a resume: the run's :class:`RunState` (which is a
checkpoint's trainer_state.json) and each hook's own ``state_dict()``. Everything else is this launch's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import os
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from accelerate.logging import get_logger
from accelerate.utils import DistributedType

from .checkpointing import (
    EXIT_PREEMPTED,
    LOCK_FILE,
    METRICS_FILE,
    SUMMARY_FILE,
    WEIGHTS_FILE,
    RunState,
    TrainingDiverged,
    lock_output_dir,
    move_previous_run_aside,
    resolve_output_dir,
    save_checkpoint,
    unlock_output_dir,
)
from .async_checkpoint import AsyncCheckpointer
from .config import TrainConfig
from .distributed import any_process, control_group, init_process_state, main_process_only
from .options import ConfigError
from .hooks.plots import CURVES_FILE
from .hooks.profiling import MEMORY_FILE
from .export import ADAPTER_WEIGHTS_FILE
from .hub import ADAPTER_CONFIG_FILE, CARD_FILE, CONFIG_FILE, GENERATION_CONFIG_FILE, TRAIN_CONFIG_FILE
from .logs import show_progress
from .metrics import Throughput, synchronize
from .speed import to_channels_last

logger = get_logger(__name__)
TOKEN_NORMALISATION_UNDER_DEEPSPEED = (
    "a task returning (loss sum, target count) needs the gradients in param.grad to normalise them, and "
    "DeepSpeed keeps them in its partitions: use DDP or FSDP for this recipe"
)


# The files a run writes at the top of its folder: in a folder that no acceltrain run has used (no .lock)
# they would replace the user's own (--output-dir . in a checkout: its README.md)
RUN_FILES = (WEIGHTS_FILE, SUMMARY_FILE, METRICS_FILE, CONFIG_FILE, GENERATION_CONFIG_FILE, CARD_FILE, TRAIN_CONFIG_FILE,
             CURVES_FILE, MEMORY_FILE, ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE)


@dataclasses.dataclass(frozen=True)
class RunSetup:
    cfg: TrainConfig  # with output_dir resolved
    output_dir: Path
    is_main_process: bool
    distributed_type: DistributedType
    num_processes: int
    found: frozenset[str] | None  # the folder's entries before this launch claimed it (main process); None: it did not exist


def setup_run(cfg: TrainConfig, name: str, task=None) -> RunSetup:
    """What every run does before it loads data: join the process group (refusing silent fallbacks),
    agree on the output folder (refusing to replace a finished run or files it did not write), and refuse a
    ``task`` that cannot work on this backend. ``fit()`` calls it; a recipe that writes into the output folder
    before training (a tokenizer) calls it first. Calling it twice is harmless."""
    state = init_process_state(cfg)
    if getattr(task, "sums_losses", False) and state.distributed_type == DistributedType.DEEPSPEED:
        raise ConfigError(TOKEN_NORMALISATION_UNDER_DEEPSPEED)
    output_dir = resolve_output_dir(cfg, name)
    found = frozenset(os.listdir(output_dir)) if state.is_main_process and output_dir.is_dir() else None
    main_process_only(lambda: _claim_output_dir(output_dir, cfg.overwrite))
    cfg = dataclasses.replace(cfg, output_dir=str(output_dir))
    return RunSetup(cfg, output_dir, state.is_main_process, state.distributed_type, state.num_processes, found)


def _claim_output_dir(output_dir: Path, overwrite: bool) -> None:
    """Refuse a folder that a live run holds, or one whose files the run would replace though no run wrote
    them; with ``--overwrite``, move the previous run aside."""
    if output_dir.is_dir() and not (output_dir / LOCK_FILE).exists():
        foreign = [name for name in RUN_FILES if (output_dir / name).exists()]
        if foreign:
            raise ConfigError(
                f"--output-dir {str(output_dir)!r} holds {', '.join(foreign)}, not written by an acceltrain run, which "
                "this run would replace: choose a new or empty --output-dir"
            )
    if overwrite:
        aside = move_previous_run_aside(output_dir)
        if aside is not None:
            logger.info(f"--overwrite: moved the previous run in {output_dir} to {aside}")
    if output_dir.is_dir():
        lock_output_dir(output_dir)


@contextlib.contextmanager
def left_as_found_unless_trained(setup: RunSetup, trained: Callable[[], bool]):
    """Bad input found after the folder was claimed (a Hub refusal in ``on_fit_start``, a checkpoint that
    does not fit, a hook that cannot be checkpointed) leaves nothing behind: when the body raises before
    training started, the main process removes what this launch added to the folder (``.lock``, an empty
    metrics.jsonl), and the folder itself if this launch made it. Nothing the folder held before is touched."""
    try:
        yield
    except Exception:
        if setup.is_main_process and not trained():
            _remove_added(setup.output_dir, setup.found)
        raise


def _remove_added(output_dir: Path, found: frozenset[str] | None) -> None:
    """Under the folder's lock, so that a run that has claimed the folder since is left alone."""
    if not output_dir.is_dir():
        return
    try:
        lock_output_dir(output_dir)
    except ConfigError:  # another live run holds it now
        return
    try:
        if found is None:
            shutil.rmtree(output_dir, ignore_errors=True)
            return
        for name in set(os.listdir(output_dir)) - found:
            path = output_dir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
    finally:
        unlock_output_dir(output_dir)


@dataclasses.dataclass
class Stop:
    """Why the run ends early. ``finish``: as a finished run (weights, summary, exit 0), e.g. a target
    reached; otherwise checkpointed to be resumed, exiting with ``exit_code`` (75, or 130 after Ctrl-C)."""

    reason: str
    finish: bool = False
    exit_code: int = EXIT_PREEMPTED


WEIGHTS_TO_EXPORT_DEPRECATED = "run.weights_to_export is deprecated: call run.request_export(weights)"


def _view(path: str, doc: str) -> property:
    """A read-only attribute: hooks read it, the loop alone changes it."""
    return property(operator.attrgetter(path), doc=doc)


class Run:
    """What every hook gets. Its public attributes are :data:`RUN_PUBLIC`, all read-only: what the run is
    made of, where it stands (its :class:`RunState`, which is a checkpoint's trainer_state.json), what
    this launch measured, and what a hook may ask for. The underscored rest is the loop's."""

    # what the run is made of, fixed before the first step
    cfg = _view("_cfg", "the resolved TrainConfig")
    accelerator = _view("_accelerator", "Accelerate's Accelerator")
    model = _view("_model", "the prepared model as Accelerate wrapped it (DDP, FSDP, DeepSpeed, compiled); its own "
                            "modules and parameter names: ``run.accelerator.unwrap_model(run.model)``")
    optimizer = _view("_optimizer", "the prepared optimizer (Accelerate's wrapper; the torch optimizer is its ``.optimizer``)")
    scheduler = _view("_scheduler", "the LR scheduler, stepped once per optimizer step on every process")
    schedule_progress = _view("_schedule_progress", "the LR schedule's progress by another measure than steps (a time budget)")
    task = _view("_task", "the task: batches into losses and eval values")
    eval_batches = _view("_eval_batches", "the prepared eval loader, or None")
    output_dir = _view("_output_dir", "the run folder (a Path)")
    runtime = _view("_runtime", "versions, device, process count and sizes, as in summary.json")
    total_steps = _view("_total_steps", "the optimizer steps the run trains for")
    batches_per_epoch = _view("_batches_per_epoch", "the per-process batches of one epoch")
    train_samples = _view("_train_samples", "the training set's size")
    flops_per_sample = _view("_flops_per_sample", "model FLOPs of one training sample (forward and backward), or None")
    peak_flops = _view("_peak_flops", "the peak FLOP/s of one device, or None")
    # where it stands: its RunState
    step = _view("_state.step", "optimizer steps done")
    epoch = _view("_state.epoch", "the epoch being trained, counted from 0")
    batch_in_epoch = _view("_state.batch_in_epoch", "per-process batches of this epoch trained on (in a step: the current one's, from 1)")
    samples_seen = _view("_state.samples_seen", "training samples seen by all processes")
    best_metric = _view("_state.best_metric", "the best primary eval metric so far, or None")
    last_eval = _view("_state.last_eval", "the latest evaluation's metrics ({} before the first)")
    # what this launch measured
    lr = _view("_lr", "the learning rate of the latest optimizer step (in on_before_optimizer_step: of the coming one)")
    grad_norm = _view("_grad_norm", "with --max-grad-norm: that step's gradient norm before clipping (a tensor); else None")
    skipped_steps = _view("_skipped_steps", "optimizer steps the fp16 grad scaler skipped (an overflow)")
    train_loss = _view("_train_loss", "the mean training loss of the latest closed window (see take_train_loss), or None")
    eval_improved = _view("_eval_improved", "whether the latest evaluation's primary metric is strictly better than any before")
    last_eval_step = _view("_last_eval_step", "the step of this launch's latest evaluation, or None")
    last_eval_started = _view("_last_eval_started", "time.perf_counter() when it started (0.0 before the first)")
    last_eval_seconds = _view("_last_eval_seconds", "how long it took, or None")
    launch_started = _view("_launch_started", "time.perf_counter() when this launch's first step started")
    throughput = _view("_throughput", "this launch's speed meter (window(), totals()); None before the first step")
    stop = _view("_stop", "why training ended early (a Stop: reason, finish), else None")

    def __init__(self, *, cfg, accelerator, model, optimizer, scheduler, schedule_progress, task, train_batches, eval_batches,
                 output_dir: Path, total_steps: int, batches_per_epoch: int, train_samples: int, data_fingerprint: str | None,
                 flops_per_sample, peak_flops, runtime: dict):
        self._cfg, self._accelerator, self._task = cfg.read_only(), accelerator, task
        self._model, self._optimizer, self._scheduler = model, optimizer, scheduler
        self._schedule_progress = schedule_progress
        self._train_batches, self._eval_batches = train_batches, eval_batches
        self._output_dir, self._runtime = output_dir, runtime
        self._batches_per_epoch = batches_per_epoch  # 0: a stream, whose passes end when the stream does
        self._stream = batches_per_epoch == 0
        self._pass_end = False  # a stream's current batch ends its pass (on every process)
        self._control_group = control_group() if self._stream and accelerator.num_processes > 1 else None  # None: gloo's default
        self._global_batch_size = cfg.batch_size * accelerator.num_processes  # of one micro-step
        self._total_steps, self._train_samples, self._data_fingerprint = total_steps, train_samples, data_fingerprint
        self._flops_per_sample, self._peak_flops = flops_per_sample, peak_flops
        self._hooks = None  # acceltrain.hooks.Hooks, set by fit()
        self._state = RunState()
        self._eval_improved, self._last_eval_step = False, None
        self._last_eval_started, self._last_eval_seconds = 0.0, None
        self._resumed_from_step = self._last_saved_step = None
        self._launch_start_step = 0
        self._throughput: Throughput | None = None
        self._started = self._launch_started = 0.0
        self._loss_sum = torch.zeros((), device=accelerator.device)
        self._loss_count = 0  # micro-batches, or loss targets (tokens) for a task that returns (sum, count)
        self._window_targets = 0  # the open window's loss targets, for a task that returns (sum, count)
        self._train_loss: float | None = None
        self._train_loss_step = 0  # the step at which the loss window was last closed
        self._lr = self._grad_norm = None
        self._skipped_steps = 0
        self._export: dict | None = None
        self._attached: list[Path] = []
        self._stop: Stop | None = None
        self._diverged = torch.zeros((), dtype=torch.bool, device=accelerator.device)
        self._save_requested = False
        self._stop_requested: Stop | None = None
        self._checkpoint_seconds = 0.0  # this launch's time blocked by saves
        self._async_saves = AsyncCheckpointer(accelerator) if cfg.async_checkpoint else None

    # ---- asked for by hooks

    def request_save(self) -> None:
        """Checkpoint after this optimizer step (at the end of the run when asked from ``on_train_end``)."""
        self._save_requested = True

    def request_stop(self, reason: str, *, finish: bool = False, exit_code: int = EXIT_PREEMPTED) -> None:
        """End training after this optimizer step: as a finished run (``finish=True``; ``reason`` becomes
        summary.json's ``stop_reason``) or checkpointed to be resumed (the process then exits with
        ``exit_code``). A stop asked for on the last step simply finishes the run."""
        if self._stop_requested is None or (finish and not self._stop_requested.finish):
            self._stop_requested = Stop(reason, finish, exit_code)

    def request_export(self, weights: dict) -> None:
        """Write ``weights`` (a state dict of the unwrapped model's names) as model.safetensors instead of the
        model's own, e.g. an average (EMA); ask in ``on_train_end``."""
        self._export = weights

    def attach(self, path: Path) -> None:
        """Attach the file at ``path`` to the tracker run when the run finishes (W&B; a profile's trace)."""
        self._attached.append(Path(path))

    @property
    def attached_files(self) -> tuple[Path, ...]:
        """The files :meth:`attach` was given, in order."""
        return tuple(self._attached)

    def log(self, metrics: dict) -> None:
        """Write one row (it needs ``"step"``): hooks may add to it, then metrics.jsonl, trackers, progress bar."""
        self._hooks.call("on_log", self, metrics)

    @contextlib.contextmanager
    def paused(self):
        """Time inside is left out of the throughput figures (evaluation, checkpointing). Before the clock
        starts (an evaluation in ``on_fit_start``) there is nothing to pause."""
        if self._throughput is None:
            yield
            return
        self._throughput.pause()
        try:
            yield
        finally:
            if self._training:
                self._throughput.resume(self.step - self._launch_start_step)

    def evaluate(self) -> dict:
        """Evaluate now (every process), keep the result and the best primary metric, log it."""
        with self.paused():
            self._last_eval_started = time.perf_counter()
            self._hooks.call("on_eval_start", self)
            metrics, samples = evaluate(self._accelerator, self._model, self._eval_batches, self._task, progress=self._cfg.progress)
            self._model.train()
            self._last_eval_seconds = time.perf_counter() - self._last_eval_started
            self._last_eval_step = self.step
            key = f"eval_{self._task.primary_metric}"
            if key not in metrics:
                raise ConfigError(
                    f"the task's primary_metric {self._task.primary_metric!r} is not among its eval metrics "
                    f"({', '.join(m.removeprefix('eval_') for m in metrics)}): set primary_metric to one of them"
                )
            self._state.last_eval = metrics
            self._eval_improved = _improves(metrics[key], self.best_metric, self._task.higher_is_better)
            if self._eval_improved:
                self._state.best_metric = metrics[key]
            self._hooks.call("on_eval_end", self, metrics)
            self.log({"step": self.step, **metrics, "eval_samples": samples, "wall_seconds": round(self.elapsed(), 3)})
        return metrics

    def take_train_loss(self) -> float:
        """The mean training loss since the window was last closed, over all processes (a collective); it
        becomes ``train_loss``. The training log closes it at each row; the run closes the rest at its end."""
        totals = self._loss_window()
        self._loss_sum.zero_()
        self._loss_count = 0
        self._train_loss, self._train_loss_step = (totals[0] / totals[1]).item(), self.step
        return self._train_loss

    # ---- read by hooks

    @property
    def epoch_progress(self) -> float:
        """Epochs done, fractional: 1.5 is the middle of the second epoch."""
        if self._stream:  # complete passes: a pass's length is not known before its end
            return float(self.epoch + bool(self.batch_in_epoch and self._epoch_ended()))
        return round(self.epoch + self.batch_in_epoch / self._batches_per_epoch, 4)

    def elapsed(self) -> float:
        """Wall-clock seconds since the run's first step, earlier launches included (before this launch's
        first step: those of the earlier launches)."""
        if self._throughput is None:
            return self._state.train_seconds
        return time.perf_counter() - self._started

    @property
    def weights_to_export(self) -> dict | None:
        """Deprecated (acceltrain 0.2): call :meth:`request_export`."""
        warnings.warn(WEIGHTS_TO_EXPORT_DEPRECATED, DeprecationWarning, stacklevel=2)
        return self._export

    @weights_to_export.setter
    def weights_to_export(self, weights: dict) -> None:
        warnings.warn(WEIGHTS_TO_EXPORT_DEPRECATED, DeprecationWarning, stacklevel=2)
        self._export = weights

    # ---- the loop's

    def _loss_window(self) -> torch.Tensor:
        """(loss sum, count) of the open training-log window, summed over processes (a collective)."""
        return self._accelerator.reduce(torch.stack([self._loss_sum, self._loss_sum.new_tensor(float(self._loss_count))]), "sum")

    def _final_train_loss(self) -> float | None:
        """summary.json's train loss: the latest window's, closing the one an early finish left open."""
        if self._train_loss_step != self.step:
            self.take_train_loss()
        return self._train_loss

    def _start_clock(self) -> None:
        """The launch's first step starts now: timers begin after the warm-up steps."""
        self._launch_start_step = self.step
        self._throughput = Throughput(self._accelerator.device,
                                      warmup_steps=min(self._cfg.timing_warmup_steps, self._total_steps - self.step - 1))
        synchronize(self._accelerator.device)
        self._launch_started = time.perf_counter()
        self._started = self._launch_started - self._state.train_seconds
        self._throughput.resume(0)

    def _epoch_batches(self):
        """This epoch's batches (the rest of it after a resume), timed; keeps ``batch_in_epoch`` current and
        moves to the next epoch when the epoch runs to its end."""
        state = self._state
        self._train_batches.set_epoch(state.epoch)
        batches = self._train_batches
        if state.batch_in_epoch and not self._stream:  # exact mid-epoch resume (a stream's loader restored its
            # position, the on-device loader skips by itself)
            skip = getattr(batches, "skip_first", None)
            batches = skip(state.batch_in_epoch) if skip else self._accelerator.skip_first_batches(batches, state.batch_in_epoch)
        iterator, resumed_at, self._pass_end = iter(batches), state.batch_in_epoch, False
        while True:
            waited = time.perf_counter()
            batch = self._next_batch(iterator, resumed_at)
            if self._stream and self._agree_on_pass_ends(iterator, batch):
                break
            if batch is None:
                break
            self._throughput.add_data_wait(time.perf_counter() - waited)
            state.batch_in_epoch += 1
            yield to_channels_last(batch) if self._cfg.channels_last else batch
            if self._pass_end:  # a stream's pass ends with this batch on every process
                self._leave_pass(iterator)
                break
        if not self._stream:  # a stream's pass ends in the loop, after on_epoch_end
            self._next_pass()

    def _next_batch(self, iterator, resumed_at: int):
        """The next batch, or None at the epoch's end. A resumed stream that ends before the checkpoint's place
        in it (the loader's fast-forward runs dry) held more data when the checkpoint was written."""
        try:
            return next(iterator)
        except StopIteration:
            return None
        except RuntimeError as err:  # "generator raised StopIteration": Accelerate's loader around the fast-forward
            if not (self._stream and resumed_at and isinstance(err.__cause__, StopIteration)):
                raise
            raise ConfigError(
                f"the training stream ended before the checkpoint's place in it (batch {resumed_at} of pass {self.epoch} on "
                "each process): it holds less data than when the checkpoint was written; restore it, or start a new --output-dir"
            ) from None

    def _agree_on_pass_ends(self, iterator, batch) -> bool:
        """Whether the stream's pass has ended before ``batch``; sets ``_pass_end`` when it ends with it. On several
        processes all agree, once per micro-batch: a stream sharded unevenly (more samples on one process than
        on another) ends its pass everywhere with the first process's end, so that no process waits for good in
        a collective the others never reach."""
        self._pass_end = batch is None or self._train_batches.end_of_dataloader
        if self._accelerator.num_processes == 1:
            return batch is None
        missing, self._pass_end = any_process(batch is None, self._pass_end, group=self._control_group)
        if self._pass_end and not self._train_batches.end_of_dataloader:  # ended by another process's stream
            # what a checkpoint taken from now on records: a finished pass (torchdata starts the next one afresh)
            self._train_batches.dl_state_dict["_iterator_finished"] = True
        if missing and batch is not None:  # another process has no batch left: this one drops its own
            self._leave_pass(iterator)
        return missing

    def _leave_pass(self, iterator) -> None:
        """End this process's pass of the stream: as the loader ends it, or, when another process's stream ended
        first, by leaving the rest untrained (a resume starts the next pass)."""
        if self._train_batches.end_of_dataloader:
            next(iterator, None)  # the loader has no batch left: let it finish its pass
            return
        iterator.close()
        self._train_batches.end()  # what the closed generator would have done at its end
        logger.warning(f"process {self._accelerator.process_index}: pass {self.epoch} of the training stream ended on another "
                       f"process after {self.batch_in_epoch} batches; the rest of this process's pass is left out (the stream "
                       "holds more samples here than there)", main_process_only=False)

    def _epoch_ended(self) -> bool:
        """Whether the batch just trained was its epoch's last (a stream's: as all processes agreed)."""
        if self._stream:
            return self._pass_end
        return self.batch_in_epoch == self._batches_per_epoch

    def _next_pass(self) -> None:
        self._state.epoch, self._state.batch_in_epoch = self._state.epoch + 1, 0

    def _window(self) -> tuple[bool, int]:
        """Whether the current micro-batch opens an accumulation window, and the window's length: grad_accum,
        or fewer for an epoch's last window; a stream's windows run across its passes' ends."""
        accum = self._cfg.grad_accum
        if self._stream:  # Accelerate's count of micro-batches, never reset by a pass's end
            return self._accelerator.step % accum == 0, accum
        start = (self.batch_in_epoch - 1) // accum * accum
        return start == self.batch_in_epoch - 1, min(accum, self._batches_per_epoch - start)

    def _step_done(self, micro_batches: int) -> None:
        """Count and time the optimizer step just taken, and note on the device (no sync) whether its loss or
        gradient norm is non-finite; a grad-scaler skip (fp16 overflow) is not divergence."""
        self._state.step += 1
        samples = micro_batches * self._global_batch_size
        self._state.samples_seen += samples
        self._throughput.step_done(self.step - self._launch_start_step, samples)
        diverged = ~torch.isfinite(self._loss_sum)
        if self._grad_norm is not None and not self._accelerator.optimizer_step_was_skipped:
            diverged |= ~torch.isfinite(torch.as_tensor(self._grad_norm, device=diverged.device))
        self._diverged = diverged

    def _agree(self) -> tuple[bool, Stop | None]:
        """This step's save and stop requests, the same on every process: one all-reduce of three flags when
        there are several processes (Accelerate's set_trigger/check_trigger carries one flag per
        collective), none on one. A process that did not ask itself learns no reason, only the kind."""
        if self._async_saves is not None and self._async_saves.in_flight:
            self._published(self._async_saves.poll())
        save, stop = self._save_requested, self._stop_requested
        self._save_requested, self._stop_requested = False, None
        if self._accelerator.num_processes > 1:
            import torch.distributed as dist

            requests = torch.tensor([save, stop is not None and not stop.finish, stop is not None and stop.finish],
                                    dtype=torch.int32, device=self._accelerator.device)
            flags = torch.cat([requests, self._diverged.view(1).int()])
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            save, resume_later, finish, diverged = (bool(flag) for flag in flags.tolist())
            if finish and not (stop and stop.finish):
                stop = Stop("requested on another process", finish=True)
            elif resume_later and not finish and stop is None:
                stop = Stop("signal or request on another process")
        else:
            diverged = bool(self._diverged)  # the one device sync per step on one process
        if diverged:
            self._raise_diverged("the training loss or gradient norm is not finite")
        return save, stop

    def _raise_diverged(self, what: str) -> None:
        norm = f" (grad norm {float(self._grad_norm):.4g})" if self._grad_norm is not None else ""
        kept = f"; the last checkpoint is step {self._last_saved_step}" if self._last_saved_step is not None else ""
        raise TrainingDiverged(
            f"training diverged at step {self.step}: {what}{norm}; nothing was saved from this step on{kept}; "
            "lower --lr or clip with --max-grad-norm"
        )

    def _snapshot(self, loss_window: tuple[float, float]) -> RunState:
        """The run state as a checkpoint records it now; ``loss_window``: the open training-log window (loss
        sum, count) summed over processes. After an epoch's last batch it points at the next epoch's start."""
        epoch, position = self.epoch, self.batch_in_epoch
        if self._epoch_ended():
            epoch, position = epoch + 1, 0
        return dataclasses.replace(
            self._state, epoch=epoch, batch_in_epoch=position, train_seconds=self.elapsed(), loss_sum=loss_window[0],
            loss_count=loss_window[1], scheduler=self._scheduler.state_dict(), hooks=list(self._hooks.stateful),
            config=self._cfg.to_dict(), **self._layout(),
        )

    def _layout(self) -> dict:
        """What a checkpoint records of the data and layout it trained on: what a resume must keep (seed, data),
        or map onto another process count."""
        processes = self._accelerator.num_processes
        return {"seed": self._cfg.seed, "global_batch_size": self._cfg.batch_size * processes, "grad_accum": self._cfg.grad_accum,
                "train_samples": self._train_samples, "data_fingerprint": self._data_fingerprint, "num_processes": processes,
                "batches_per_epoch": self._batches_per_epoch}

    def _restore(self, state: RunState) -> None:
        """Continue from a checkpoint's run state (Accelerate has loaded model, optimizer and RNG)."""
        self._state = state
        self._resumed_from_step = self._last_saved_step = self._train_loss_step = state.step
        if self._accelerator.is_main_process:  # the window's sum over all processes, counted once
            self._loss_sum.fill_(state.loss_sum)
            self._loss_count = state.loss_count
        if state.scheduler:
            self._scheduler.load_state_dict(state.scheduler)

    def _save(self) -> None:
        """Checkpoint now (every process): Accelerate's state, the run state, the hooks' states; published at once, or
        under ``--async-checkpoint`` once written (:meth:`_agree` asks each step). Logs the time it blocked training."""
        with self.paused():
            started = time.perf_counter()
            finite = torch.stack([torch.isfinite(p).all() for p in self._model.parameters()]).all()
            window = self._loss_window()
            if not finite:  # a finite loss can still leave inf weights behind: never checkpoint them
                self._raise_diverged("the weights are not finite")
            state = self._snapshot((window[0].item(), window[1].item()))
            if self._async_saves is None:
                path = save_checkpoint(self._accelerator, state, self._output_dir, write_extra=self._hooks.save_states)
            else:  # at most one save in flight: the previous one is published (and announced) first
                self._published(self._async_saves.wait())
                self._async_saves.save(self._model, self._optimizer, state, self._output_dir, self._hooks.save_states)
                path = None
            self._last_saved_step = self.step
            self._published(path)
            self._checkpoint_blocked(started)

    @property
    def _training(self) -> bool:
        """Still training: not after the run's end (its logs may be closed)."""
        return self._stop is None and self.step < self._total_steps

    def _checkpoint_blocked(self, since: float) -> None:
        """Count the time a save blocked training; a row of the training log says it while the run trains (the
        saves at its end are in summary.json's total)."""
        blocked = time.perf_counter() - since
        self._checkpoint_seconds += blocked
        if self._training:
            self.log({"step": self.step, "checkpoint_seconds": round(blocked, 4), "wall_seconds": round(self.elapsed(), 3)})

    def _published(self, path: Path | None) -> None:
        if path is not None:
            self._hooks.call("on_save", self, path)
            logger.info(f"checkpoint: {path}")

    def _wait_for_checkpoint(self) -> None:
        """The end of a launch waits for a save in flight: its checkpoint is published before the run stops. (Not
        counted in ``checkpoint_seconds``: training is over.)"""
        if self._async_saves is not None and self._async_saves.in_flight:
            self._published(self._async_saves.wait())


# Run's public attributes, all read-only (tested against a real run): the list the docs give.
RUN_PUBLIC = (
    # what the run is made of
    "cfg", "accelerator", "model", "optimizer", "scheduler", "schedule_progress", "task", "eval_batches", "output_dir",
    "runtime", "total_steps", "batches_per_epoch", "train_samples", "flops_per_sample", "peak_flops",
    # where it stands (its RunState)
    "step", "epoch", "batch_in_epoch", "samples_seen", "best_metric", "last_eval", "epoch_progress",
    # what this launch measured
    "lr", "grad_norm", "skipped_steps", "train_loss", "eval_improved", "last_eval_step", "last_eval_started",
    "last_eval_seconds", "launch_started", "throughput", "stop", "attached_files", "elapsed",
    # what a hook may ask for
    "request_save", "request_stop", "request_export", "attach", "log", "evaluate", "paused", "take_train_loss",
)
RUN_DEPRECATED = ("weights_to_export",)  # kept for one release, with a DeprecationWarning


def _improves(value: float, best: float | None, higher_is_better: bool) -> bool:
    if value != value:  # NaN is never the best
        return False
    if best is None:
        return True
    return value > best if higher_is_better else value < best


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
        for batch in tqdm(batches, desc="eval", unit="batch", leave=False, dynamic_ncols=True,
                          disable=not (show_progress(progress) and accelerator.is_main_process)):
            values = accelerator.gather_for_metrics(task.eval_values(model, batch))
            for key, value in values.items():
                totals[key] = totals.get(key, 0) + value.double().sum()
            count += len(next(iter(values.values())))
    sums = {key: total.item() for key, total in totals.items()}
    summarise = getattr(task, "eval_metrics", None)
    metrics = summarise(sums, count) if summarise else {key: total / count for key, total in sums.items()}
    return {f"eval_{key}": value for key, value in metrics.items()}, count
