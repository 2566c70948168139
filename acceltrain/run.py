"""The run: one object that holds where training stands and what it is made of, handed to every hook.

Hooks read it (``run.step``, ``run.epoch``, ``run.model``, ``run.last_eval``, ``run.cfg``, ...) and ask
it for things (``request_save``, ``request_stop``, ``log``, ``evaluate``, ``paused``). Exactly one
function, :meth:`Run.trainer_state`, turns it into the :class:`TrainerState` a checkpoint records.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import time
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
    TrainerState,
    TrainingDiverged,
    lock_output_dir,
    move_previous_run_aside,
    resolve_output_dir,
    save_checkpoint,
    unlock_output_dir,
)
from .config import ConfigError, TrainConfig
from .distributed import init_process_state, main_process_only
from .hooks.plots import CURVES_FILE
from .hooks.profiling import MEMORY_FILE
from .hub import CARD_FILE, CONFIG_FILE, GENERATION_CONFIG_FILE, TRAIN_CONFIG_FILE
from .logs import show_progress
from .metrics import Throughput, synchronize

logger = get_logger(__name__)
TOKEN_NORMALISATION_UNDER_DEEPSPEED = (
    "a task returning (loss sum, target count) needs the gradients in param.grad to normalise them, and "
    "DeepSpeed keeps them in its partitions: use DDP or FSDP for this recipe"
)


# The files a run writes at the top of its folder: in a folder that no acceltrain run has used (no .lock)
# they would replace the user's own (--output-dir . in a checkout: its README.md)
RUN_FILES = (WEIGHTS_FILE, SUMMARY_FILE, METRICS_FILE, CONFIG_FILE, GENERATION_CONFIG_FILE, CARD_FILE, TRAIN_CONFIG_FILE,
             CURVES_FILE, MEMORY_FILE)


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


class Run:
    def __init__(self, *, cfg, accelerator, model, optimizer, scheduler, schedule_progress, task, train_batches, eval_batches,
                 output_dir: Path, total_steps: int, train_samples: int, flops_per_sample, peak_flops, runtime: dict):
        self.cfg, self.accelerator, self.task = cfg, accelerator, task
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.schedule_progress = schedule_progress  # the LR schedule's progress by another measure than steps (time)
        self.train_batches, self.eval_batches = train_batches, eval_batches
        self.output_dir, self.runtime = output_dir, runtime
        self.batches_per_epoch = len(train_batches)
        self.global_batch_size = cfg.batch_size * accelerator.num_processes  # of one micro-step
        self.total_steps, self.train_samples = total_steps, train_samples
        self.flops_per_sample, self.peak_flops = flops_per_sample, peak_flops
        self.hooks = None  # acceltrain.hooks.Hooks, set by fit()
        # where the run stands: saved in checkpoints
        self.step = self.epoch = self.batch_in_epoch = self.samples_seen = 0
        self.train_seconds_before = 0.0  # training time of earlier launches of this run
        self.last_eval: dict = {}
        self.last_eval_started, self.last_eval_seconds = 0.0, None  # perf_counter and duration of the latest evaluation
        self.last_eval_step: int | None = None  # the step of this launch's latest evaluation
        self.best_metric: float | None = None
        self.best_checkpoint: str | None = None
        self.tracker_run_id: str | None = None
        # this launch
        self.resumed_from_step: int | None = None
        self.launch_start_step = 0
        self.throughput: Throughput | None = None
        self.started = self.launch_started = 0.0
        self.loss_sum = torch.zeros((), device=accelerator.device)
        self.loss_count = 0  # micro-batches, or loss targets (tokens) for a task that returns (sum, count)
        self.train_loss: float | None = None  # the last logged one
        self.lr = self.grad_norm = None  # of the last optimizer step
        self.skipped_steps = 0  # fp16 overflow: the grad scaler skipped the optimizer step
        self.eval_improved = False
        self.last_saved_step: int | None = None
        self.weights_to_export: dict | None = None  # a hook's replacement for the model's weights (EMA)
        self.files_to_attach: list[Path] = []  # attached to the tracker run at the end (profiles)
        self.config_changes: dict = {}  # applied on resume with --allow-config-change: field -> [old, new]
        self.stop: Stop | None = None
        self._diverged = torch.zeros((), dtype=torch.bool, device=accelerator.device)
        self._save_requested = False
        self._stop_requested: Stop | None = None

    # ---- asked for by hooks

    def request_save(self) -> None:
        """Checkpoint after this optimizer step (at the end of the run when asked from ``on_train_end``)."""
        self._save_requested = True

    def request_stop(self, reason: str, *, finish: bool = False, exit_code: int = EXIT_PREEMPTED) -> None:
        """End training after this optimizer step: as a finished run (``finish=True``) or checkpointed to be
        resumed (the process then exits with ``exit_code``). A stop asked for on the last step simply
        finishes the run."""
        if self._stop_requested is None or (finish and not self._stop_requested.finish):
            self._stop_requested = Stop(reason, finish, exit_code)

    def log(self, metrics: dict) -> None:
        """Write one row (it needs ``"step"``): hooks may add to it, then metrics.jsonl, trackers, progress bar."""
        self.hooks.call("on_log", self, metrics)

    @contextlib.contextmanager
    def paused(self):
        """Time inside is left out of the throughput figures (evaluation, checkpointing). Before the clock
        starts (an evaluation in ``on_fit_start``) there is nothing to pause."""
        if self.throughput is None:
            yield
            return
        self.throughput.pause()
        try:
            yield
        finally:
            if self.stop is None and self.step < self.total_steps:  # still training: not after the run's end
                self.throughput.resume(self.step - self.launch_start_step)

    def evaluate(self) -> dict:
        """Evaluate now (every process), keep the result and the best primary metric, log it."""
        with self.paused():
            self.last_eval_started = time.perf_counter()
            self.hooks.call("on_eval_start", self)
            metrics, samples = evaluate(self.accelerator, self.model, self.eval_batches, self.task, progress=self.cfg.progress)
            self.model.train()
            self.last_eval_seconds = time.perf_counter() - self.last_eval_started
            self.last_eval_step = self.step
            key = f"eval_{self.task.primary_metric}"
            if key not in metrics:
                raise ConfigError(
                    f"the task's primary_metric {self.task.primary_metric!r} is not among its eval metrics "
                    f"({', '.join(m.removeprefix('eval_') for m in metrics)}): set primary_metric to one of them"
                )
            self.last_eval = metrics
            self.eval_improved = _improves(metrics[key], self.best_metric, self.task.higher_is_better)
            if self.eval_improved:
                self.best_metric = metrics[key]
            self.hooks.call("on_eval_end", self, metrics)
            self.log({"step": self.step, **metrics, "eval_samples": samples, "wall_seconds": round(self.elapsed(), 3)})
        return metrics

    # ---- read by hooks

    @property
    def epoch_progress(self) -> float:
        """Epochs done, fractional: 1.5 is the middle of the second epoch."""
        return round(self.epoch + self.batch_in_epoch / self.batches_per_epoch, 4)

    def elapsed(self) -> float:
        """Wall-clock seconds since the run's first step, earlier launches included (before this launch's
        first step: those of the earlier launches)."""
        if self.throughput is None:
            return self.train_seconds_before
        return time.perf_counter() - self.started

    def take_train_loss(self) -> float:
        """The mean training loss since the last call, over all processes (a collective)."""
        totals = self._loss_window()
        self.loss_sum.zero_()
        self.loss_count = 0
        return (totals[0] / totals[1]).item()

    def _loss_window(self) -> torch.Tensor:
        """(loss sum, count) of the open training-log window, summed over processes (a collective)."""
        return self.accelerator.reduce(torch.stack([self.loss_sum, self.loss_sum.new_tensor(float(self.loss_count))]), "sum")

    # ---- used by the loop

    def start_clock(self) -> None:
        """The launch's first step starts now: timers begin after the warm-up steps."""
        self.launch_start_step = self.step
        self.throughput = Throughput(self.accelerator.device, warmup_steps=min(self.cfg.timing_warmup_steps, self.total_steps - self.step - 1))
        synchronize(self.accelerator.device)
        self.launch_started = time.perf_counter()
        self.started = self.launch_started - self.train_seconds_before
        self.throughput.resume(0)

    def epoch_batches(self):
        """This epoch's batches (the rest of it after a resume), timed; keeps ``batch_in_epoch`` current and
        moves to the next epoch when the epoch runs to its end."""
        self.train_batches.set_epoch(self.epoch)
        batches = self.train_batches
        if self.batch_in_epoch:  # exact mid-epoch resume; the on-device loader skips by itself
            skip = getattr(batches, "skip_first", None)
            batches = skip(self.batch_in_epoch) if skip else self.accelerator.skip_first_batches(batches, self.batch_in_epoch)
        iterator = iter(batches)
        while True:
            waited = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                break
            self.throughput.add_data_wait(time.perf_counter() - waited)
            self.batch_in_epoch += 1
            yield batch
        self.epoch, self.batch_in_epoch = self.epoch + 1, 0

    def step_done(self, micro_batches: int) -> None:
        """Count and time the optimizer step just taken, and note on the device (no sync) whether its loss or
        gradient norm is non-finite; a grad-scaler skip (fp16 overflow) is not divergence."""
        self.step += 1
        samples = micro_batches * self.global_batch_size
        self.samples_seen += samples
        self.throughput.step_done(self.step - self.launch_start_step, samples)
        diverged = ~torch.isfinite(self.loss_sum)
        if self.grad_norm is not None and not self.accelerator.optimizer_step_was_skipped:
            diverged |= ~torch.isfinite(torch.as_tensor(self.grad_norm, device=diverged.device))
        self._diverged = diverged

    def agree(self) -> tuple[bool, Stop | None]:
        """This step's save and stop requests, the same on every process: one all-reduce of three flags when
        there are several processes (Accelerate's set_trigger/check_trigger carries one flag per
        collective), none on one. A process that did not ask itself learns no reason, only the kind."""
        save, stop = self._save_requested, self._stop_requested
        self._save_requested, self._stop_requested = False, None
        if self.accelerator.num_processes > 1:
            import torch.distributed as dist

            requests = torch.tensor([save, stop is not None and not stop.finish, stop is not None and stop.finish],
                                    dtype=torch.int32, device=self.accelerator.device)
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
        norm = f" (grad norm {float(self.grad_norm):.4g})" if self.grad_norm is not None else ""
        kept = f"; the last checkpoint is step {self.last_saved_step}" if self.last_saved_step is not None else ""
        raise TrainingDiverged(
            f"training diverged at step {self.step}: {what}{norm}; nothing was saved from this step on{kept}; "
            "lower --lr or clip with --max-grad-norm"
        )

    def trainer_state(self, loss_window: tuple[float, float] = (0.0, 0.0)) -> TrainerState:
        """The one place where the run becomes a checkpoint's TrainerState. ``loss_window``: the open
        training-log window (loss sum, count) summed over processes."""
        epoch, position = self.epoch, self.batch_in_epoch
        if position == self.batches_per_epoch:  # the epoch's last batch is done: resume at the next epoch
            epoch, position = epoch + 1, 0
        return TrainerState(
            step=self.step, epoch=epoch, batches_in_epoch=position, samples_seen=self.samples_seen,
            train_seconds=self.elapsed(), best_metric=self.best_metric, best_checkpoint=self.best_checkpoint,
            last_eval=self.last_eval, tracker_run_id=self.tracker_run_id, scheduler=self.scheduler.state_dict(),
            hooks=list(self.hooks.stateful), loss_sum=loss_window[0], loss_count=loss_window[1], config=self.cfg.to_dict(),
            config_changes=self.config_changes, **compatibility(self.cfg, self.accelerator.num_processes, self.train_samples),
        )

    def restore(self, state: TrainerState) -> None:
        self.step, self.epoch, self.batch_in_epoch = state.step, state.epoch, state.batches_in_epoch
        self.samples_seen, self.train_seconds_before = state.samples_seen, state.train_seconds
        self.best_metric, self.best_checkpoint, self.last_eval = state.best_metric, state.best_checkpoint, state.last_eval
        self.tracker_run_id = state.tracker_run_id
        self.resumed_from_step = self.last_saved_step = state.step
        self.config_changes = dict(state.config_changes)
        if self.accelerator.is_main_process:  # the window's sum over all processes, counted once
            self.loss_sum.fill_(state.loss_sum)
            self.loss_count = state.loss_count
        if state.scheduler:
            self.scheduler.load_state_dict(state.scheduler)

    def save(self) -> Path:
        """Checkpoint now (every process): Accelerate's state, the trainer state, the hooks' states."""
        with self.paused():
            finite = torch.stack([torch.isfinite(p).all() for p in self.model.parameters()]).all()
            window = self._loss_window()
            if not finite:  # a finite loss can still leave inf weights behind: never checkpoint them
                self._raise_diverged("the weights are not finite")
            state = self.trainer_state(loss_window=(window[0].item(), window[1].item()))
            path = save_checkpoint(self.accelerator, state, self.output_dir, write_extra=self.hooks.save_states)
            self.last_saved_step = self.step
            self.hooks.call("on_save", self, path)
            logger.info(f"checkpoint: {path}")
        return path


def compatibility(cfg: TrainConfig, num_processes: int, train_samples: int) -> dict:
    """What must not change across a resume for it to be exact."""
    return {"seed": cfg.seed, "global_batch_size": cfg.batch_size * num_processes, "grad_accum": cfg.grad_accum,
            "train_samples": train_samples}


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
