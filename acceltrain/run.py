"""The run: one object that holds where training stands and what it is made of, handed to every hook.

Hooks read it (``run.step``, ``run.epoch``, ``run.model``, ``run.last_eval``, ``run.cfg``, ...) and ask
it for things (``request_save``, ``request_stop``, ``log``, ``evaluate``, ``paused``). Exactly one
function, :meth:`Run.trainer_state`, turns it into the :class:`TrainerState` a checkpoint records.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path

import torch
from accelerate.utils import DistributedType

from .checkpointing import TrainerState, resolve_output_dir, save_checkpoint
from .config import ConfigError, TrainConfig
from .distributed import init_process_state
from .metrics import Throughput, synchronize

TOKEN_NORMALISATION_UNDER_DEEPSPEED = (
    "a task returning (loss sum, target count) needs the gradients in param.grad to normalise them, and "
    "DeepSpeed keeps them in its partitions: use DDP or FSDP for this recipe"
)


@dataclasses.dataclass(frozen=True)
class RunSetup:
    cfg: TrainConfig  # with output_dir resolved
    output_dir: Path
    is_main_process: bool
    distributed_type: DistributedType
    num_processes: int


def setup_run(cfg: TrainConfig, name: str, task=None) -> RunSetup:
    """What every run does before it loads data: join the process group (refusing silent fallbacks),
    agree on the output folder (refusing to replace a finished run), and refuse a ``task`` that cannot work
    on this backend. ``fit()`` calls it; a recipe that writes into the output folder before training (a
    tokenizer) calls it first. Calling it twice is harmless."""
    state = init_process_state(cfg)
    if getattr(task, "sums_losses", False) and state.distributed_type == DistributedType.DEEPSPEED:
        raise ConfigError(TOKEN_NORMALISATION_UNDER_DEEPSPEED)
    output_dir = resolve_output_dir(cfg, name)
    cfg = dataclasses.replace(cfg, output_dir=str(output_dir))
    return RunSetup(cfg, output_dir, state.is_main_process, state.distributed_type, state.num_processes)


@dataclasses.dataclass
class Stop:
    """Why the run ends early. ``finish``: as a finished run (weights, summary, exit 0), e.g. a target
    reached; otherwise checkpointed to be resumed (exit 75), e.g. a preemption signal."""

    reason: str
    finish: bool = False


class Run:
    def __init__(self, *, cfg, accelerator, model, optimizer, scheduler, task, train_batches, eval_batches,
                 output_dir: Path, total_steps: int, train_samples: int, flops_per_sample, peak_flops, runtime: dict):
        self.cfg, self.accelerator, self.task = cfg, accelerator, task
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
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
        self.stop: Stop | None = None
        self._save_requested = False
        self._stop_requested: Stop | None = None

    # ---- asked for by hooks

    def request_save(self) -> None:
        """Checkpoint after this optimizer step (at the end of the run when asked from ``on_train_end``)."""
        self._save_requested = True

    def request_stop(self, reason: str, *, finish: bool = False) -> None:
        """End training after this optimizer step: as a finished run (``finish=True``) or checkpointed to be
        resumed. A stop asked for on the last step simply finishes the run."""
        if self._stop_requested is None or (finish and not self._stop_requested.finish):
            self._stop_requested = Stop(reason, finish)

    def log(self, metrics: dict) -> None:
        """Write one row (it needs ``"step"``): hooks may add to it, then metrics.jsonl, trackers, progress bar."""
        self.hooks.call("on_log", self, metrics)

    @contextlib.contextmanager
    def paused(self):
        """Time inside is left out of the throughput figures (evaluation, checkpointing)."""
        self.throughput.pause()
        try:
            yield
        finally:
            if self.step < self.total_steps:
                self.throughput.resume(self.step - self.launch_start_step)

    def evaluate(self) -> dict:
        """Evaluate now (every process), keep the result and the best primary metric, log it."""
        with self.paused():
            self.hooks.call("on_eval_start", self)
            metrics, samples = evaluate(self.accelerator, self.model, self.eval_batches, self.task)
            self.model.train()
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
        """Wall-clock seconds since the run's first step, earlier launches included."""
        return time.perf_counter() - self.started

    def take_train_loss(self) -> float:
        """The mean training loss since the last call, over all processes (a collective)."""
        totals = self.accelerator.reduce(torch.stack([self.loss_sum, self.loss_sum.new_tensor(float(self.loss_count))]), "sum")
        self.loss_sum.zero_()
        self.loss_count = 0
        return (totals[0] / totals[1]).item()

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

    def agree(self) -> tuple[bool, Stop | None]:
        """This step's save and stop requests, the same on every process: one all-reduce of three flags when
        there are several processes (Accelerate's set_trigger/check_trigger carries one flag per
        collective), none on one. A process that did not ask itself learns no reason, only the kind."""
        save, stop = self._save_requested, self._stop_requested
        self._save_requested, self._stop_requested = False, None
        if self.accelerator.num_processes > 1:
            import torch.distributed as dist

            flags = torch.tensor([save, stop is not None and not stop.finish, stop is not None and stop.finish],
                                 dtype=torch.int32, device=self.accelerator.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            save, resume_later, finish = (bool(flag) for flag in flags.tolist())
            if finish and not (stop and stop.finish):
                stop = Stop("requested on another process", finish=True)
            elif resume_later and not finish and stop is None:
                stop = Stop("signal or request on another process")
        return save, stop

    def trainer_state(self) -> TrainerState:
        """The one place where the run becomes a checkpoint's TrainerState."""
        epoch, position = self.epoch, self.batch_in_epoch
        if position == self.batches_per_epoch:  # the epoch's last batch is done: resume at the next epoch
            epoch, position = epoch + 1, 0
        return TrainerState(
            step=self.step, epoch=epoch, batches_in_epoch=position, samples_seen=self.samples_seen,
            train_seconds=self.elapsed(), best_metric=self.best_metric, best_checkpoint=self.best_checkpoint,
            last_eval=self.last_eval, tracker_run_id=self.tracker_run_id, scheduler=self.scheduler.state_dict(),
            hooks=list(self.hooks.stateful), **compatibility(self.cfg, self.accelerator.num_processes, self.train_samples),
        )

    def restore(self, state: TrainerState) -> None:
        self.step, self.epoch, self.batch_in_epoch = state.step, state.epoch, state.batches_in_epoch
        self.samples_seen, self.train_seconds_before = state.samples_seen, state.train_seconds
        self.best_metric, self.best_checkpoint, self.last_eval = state.best_metric, state.best_checkpoint, state.last_eval
        self.tracker_run_id = state.tracker_run_id
        self.resumed_from_step = self.last_saved_step = state.step
        if state.scheduler:
            self.scheduler.load_state_dict(state.scheduler)

    def save(self) -> Path:
        """Checkpoint now (every process): Accelerate's state, the trainer state, the hooks' states."""
        with self.paused():
            path = save_checkpoint(self.accelerator, self.trainer_state(), self.output_dir, write_extra=self.hooks.save_states)
            self.last_saved_step = self.step
            self.hooks.call("on_save", self, path)
            self.accelerator.print(f"checkpoint: {path}")
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


def evaluate(accelerator, model, batches, task) -> tuple[dict[str, float], int]:
    """Each per-sample eval value summed over the whole eval set, exact across processes
    (``gather_for_metrics`` drops the samples that even batches padded onto the last one), then turned
    into metrics by ``task.eval_metrics(sums, samples)`` if the task has it, else into means."""
    model.eval()
    totals: dict[str, torch.Tensor] = {}
    count = 0
    with torch.no_grad():
        for batch in batches:
            values = accelerator.gather_for_metrics(task.eval_values(model, batch))
            for key, value in values.items():
                totals[key] = totals.get(key, 0) + value.double().sum()
            count += len(next(iter(values.values())))
    sums = {key: total.item() for key, total in totals.items()}
    summarise = getattr(task, "eval_metrics", None)
    metrics = summarise(sums, count) if summarise else {key: total / count for key, total in sums.items()}
    return {f"eval_{key}": value for key, value in metrics.items()}, count
