"""The training state: where training stands and how it advances, with one owner, the loop.

:class:`TrainState` holds the :class:`~acceltrain.checkpoint.RunState` (what a checkpoint's ``trainer_state.json``
records) and this launch's measures. It changes only through its named methods: a micro-batch's loss added, an
optimizer step taken, an evaluation recorded, a save or stop asked for. It walks each epoch's batches (a resume's rest
of one included, a stream's passes agreed by every process), knows each accumulation window, times each optimizer
step, keeps the training-loss window, and makes the one agreement per optimizer step on whether to save, stop or give
up on a diverged run. Hooks read it through :class:`~acceltrain.train.run.Run`; the checkpointer takes what a
checkpoint records (:meth:`~TrainState.snapshot`) and gives it back (:meth:`~TrainState.restore`, or a live peer's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch
from accelerate.logging import get_logger

from acceltrain.checkpoint.state import RunState
from acceltrain.config.options import ConfigError
from acceltrain.data.streams import agree_on_pass_end, leave_pass, next_batch
from acceltrain.runtime.distributed import control_group
from acceltrain.runtime.metrics import Throughput, synchronize
from acceltrain.runtime.preemption import Stop, TrainingDiverged
from acceltrain.train.speed import to_channels_last

logger = get_logger(__name__)


class TrainState:
    """The run's training state over its prepared pieces (see the module docstring): read by the loop and, through
    :class:`~acceltrain.train.run.Run`, by hooks; changed only by its methods."""

    def __init__(self, prepared):
        self.cfg, self.accelerator, self.train_batches = prepared.cfg, prepared.accelerator, prepared.train_batches
        self.total_steps, self.batches_per_epoch = prepared.total_steps, prepared.batches_per_epoch
        self.train_samples, self.data_fingerprint = prepared.train_samples, prepared.data_fingerprint
        cfg, accelerator = self.cfg, self.accelerator
        self.stream = self.batches_per_epoch == 0  # a stream's passes end when the stream does
        self.copies = prepared.engine.data_shard()[1]  # of the run, reading other data (torchft's replica groups)
        self.global_batch_size = cfg.batch_size * accelerator.num_processes * self.copies  # of one micro-step
        self.control_group = control_group() if self.stream and accelerator.num_processes > 1 else None
        self.run_state = RunState()
        self.pass_end = False  # a stream's current batch ends its pass (on every process)
        # the training-log window: micro-batches, or loss targets (tokens) for a task that returns (sum, count)
        self.loss_sum = torch.zeros((), device=accelerator.device)
        self.loss_count = 0
        self.window_targets = 0  # the open accumulation window's loss targets, for a task that returns (sum, count)
        self.window_drawn = 0  # micro-batches drawn since the last optimizer step
        self.stepped = True  # whether the last optimizer step was taken
        self.train_loss: float | None = None
        self.train_loss_step = 0  # the step at which the loss window was last closed
        # this launch's measures, read by hooks through Run
        self.lr = self.grad_norm = None
        self.skipped_steps = 0
        self.eval_improved, self.last_eval_step = False, None
        self.last_eval_started, self.last_eval_seconds = 0.0, None
        self.throughput: Throughput | None = None
        self.started = self.launch_started = 0.0
        self.launch_start_step = 0
        # what hooks asked for
        self.save_requested = False
        self.stop_requested: Stop | None = None
        self.stop: Stop | None = None
        self.export: dict | None = None
        self.attached: list = []
        self.diverged = torch.zeros((), dtype=torch.bool, device=accelerator.device)
        self.last_saved_step: int | None = None  # told by the checkpointer, for the divergence message

    @property
    def step(self) -> int:
        return self.run_state.step

    @property
    def training(self) -> bool:
        """Still training: not after the run's end (its logs may be closed)."""
        return self.stop is None and self.step < self.total_steps

    # ---- the clock

    def start_clock(self) -> None:
        """The launch's first step starts now: timers begin after the warm-up steps."""
        self.launch_start_step = self.step
        self.throughput = Throughput(
            self.accelerator.device, warmup_steps=min(self.cfg.timing_warmup_steps, self.total_steps - self.step - 1)
        )
        synchronize(self.accelerator.device)
        self.launch_started = time.perf_counter()
        self.started = self.launch_started - self.run_state.train_seconds
        self.throughput.resume(0)

    def elapsed(self) -> float:
        """Wall-clock seconds since the run's first step, earlier launches included (before this launch's
        first step: those of the earlier launches)."""
        if self.throughput is None:
            return self.run_state.train_seconds
        return time.perf_counter() - self.started

    @contextlib.contextmanager
    def paused(self):
        """Time inside is left out of the throughput figures. Before the clock starts there is nothing to pause."""
        if self.throughput is None:
            yield
            return
        self.throughput.pause()
        try:
            yield
        finally:
            if self.training:
                self.throughput.resume(self.step - self.launch_start_step)

    # ---- the batches

    def epoch_batches(self):
        """This epoch's batches (the rest of it after a resume), timed; keeps ``batch_in_epoch`` current and
        moves to the next epoch when the epoch runs to its end."""
        state, batches = self.run_state, self.train_batches
        batches.set_epoch(state.epoch)
        if state.batch_in_epoch and not self.stream:  # exact mid-epoch resume (a stream's loader restored its
            # position, the on-device loader skips by itself)
            skip = getattr(batches, "skip_first", None)
            batches = (
                skip(state.batch_in_epoch)
                if skip
                else self.accelerator.skip_first_batches(batches, state.batch_in_epoch)
            )
        iterator, resumed_at, self.pass_end = iter(batches), state.batch_in_epoch, False
        while True:
            waited = time.perf_counter()
            batch = next_batch(iterator, _END, resumed_at if self.stream else 0, state.epoch)
            if self.stream and self._agree_on_pass_ends(iterator, batch):
                break
            if batch is _END:
                break
            if batch is None:  # the loop's own end of an epoch was once None: a user's None ended every epoch at once
                raise ConfigError(
                    "a training batch is None: the collate function returned nothing (a missing return?); it "
                    "must return a batch the task takes"
                )
            self.throughput.add_data_wait(time.perf_counter() - waited)
            state.batch_in_epoch += 1
            self.window_drawn += 1
            yield to_channels_last(batch) if self.cfg.channels_last else batch
            if self.pass_end:  # a stream's pass ends with this batch on every process
                self._leave_pass(iterator)
                break
        if not self.stream:  # a stream's pass ends in the loop, after on_epoch_end
            self.next_pass()

    def _agree_on_pass_ends(self, iterator, batch) -> bool:
        """Whether the stream's pass has ended before ``batch`` (:func:`.streams.agree_on_pass_end`); sets
        ``pass_end`` when it ends with it."""
        missing, self.pass_end = agree_on_pass_end(
            self.train_batches, batch is _END, self.accelerator.num_processes, self.control_group
        )
        if missing and batch is not _END:  # another process has no batch left: this one drops its own
            self._leave_pass(iterator)
        return missing

    def _leave_pass(self, iterator) -> None:
        state = self.run_state
        leave_pass(self.train_batches, iterator, self.accelerator.process_index, state.epoch, state.batch_in_epoch)

    def epoch_ended(self) -> bool:
        """Whether the batch just trained was its epoch's last (a stream's: as all processes agreed)."""
        if self.stream:
            return self.pass_end
        return self.run_state.batch_in_epoch == self.batches_per_epoch

    def next_pass(self) -> None:
        self.run_state.epoch, self.run_state.batch_in_epoch = self.run_state.epoch + 1, 0

    @property
    def epoch_progress(self) -> float:
        """Epochs done, fractional: 1.5 is the middle of the second epoch."""
        if self.stream:  # complete passes: a pass's length is not known before its end
            return float(self.run_state.epoch + bool(self.run_state.batch_in_epoch and self.epoch_ended()))
        return round(self.run_state.epoch + self.run_state.batch_in_epoch / self.batches_per_epoch, 4)

    # ---- the steps

    def window(self) -> tuple[bool, int]:
        """Whether the current micro-batch opens an accumulation window, and the window's length: grad_accum,
        or fewer for an epoch's last window; a stream's windows run across its passes' ends."""
        accum = self.cfg.grad_accum
        if self.stream:  # Accelerate's count of micro-batches, never reset by a pass's end
            return self.accelerator.step % accum == 0, accum
        position = self.run_state.batch_in_epoch
        start = (position - 1) // accum * accum
        return start == position - 1, min(accum, self.batches_per_epoch - start)

    def add_loss(self, loss: torch.Tensor, count) -> None:
        """A micro-batch's loss joins the training-log window: a mean loss counts 1, a summed one its target count
        (a tensor), which also joins the open accumulation window's count that its gradients are divided by."""
        self.loss_sum += loss.detach().float()
        self.loss_count += count
        if isinstance(count, torch.Tensor):
            self.window_targets += count

    def take_window_targets(self) -> torch.Tensor | None:
        """The open accumulation window's loss targets (None for mean losses), and a new window."""
        targets, self.window_targets = self.window_targets, 0
        return targets if isinstance(targets, torch.Tensor) else None

    def optimizer_stepping(self, lr: float, grad_norm) -> None:
        """The coming optimizer step's learning rate, and its gradients' norm before clipping (or None)."""
        self.lr, self.grad_norm = lr, grad_norm

    def optimizer_stepped(self, taken: bool) -> bool:
        """The optimizer step was ``taken`` (returned) or skipped (fp16 grad scaler; a quorum that did not commit)."""
        self.stepped = taken
        return taken

    def step_done(self, micro_batches: int) -> None:
        """Count and time the optimizer step just taken (or skipped), and note on the device (no sync) whether its
        loss or gradient norm is non-finite; a skipped step is not divergence."""
        self.window_drawn = 0
        if not self.stepped:
            self.skipped_steps += 1
        self.run_state.step += 1
        samples = micro_batches * self.global_batch_size
        self.run_state.samples_seen += samples
        self.throughput.step_done(self.step - self.launch_start_step, samples // self.copies)  # this copy's speed
        diverged = ~torch.isfinite(self.loss_sum)
        if self.grad_norm is not None and self.stepped:
            diverged |= ~torch.isfinite(torch.as_tensor(self.grad_norm, device=diverged.device))
        self.diverged = diverged

    def agree(self) -> tuple[bool, Stop | None]:
        """This step's save and stop requests, the same on every process: one all-reduce of four flags when
        there are several processes (Accelerate's set_trigger/check_trigger carries one flag per
        collective), none on one. A process that did not ask itself learns no reason, only the kind."""
        save, stop = self.save_requested, self.stop_requested
        self.save_requested, self.stop_requested = False, None
        if self.accelerator.num_processes > 1:
            import torch.distributed as dist

            requests = torch.tensor(
                [save, stop is not None and not stop.finish, stop is not None and stop.finish],
                dtype=torch.int32,
                device=self.accelerator.device,
            )
            flags = torch.cat([requests, self.diverged.view(1).int()])
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            save, resume_later, finish, diverged = (bool(flag) for flag in flags.tolist())
            if finish and not (stop and stop.finish):
                stop = Stop("requested on another process", finish=True)
            elif resume_later and not finish and stop is None:
                stop = Stop("signal or request on another process")
        else:
            diverged = bool(self.diverged)  # the one device sync per step on one process
        if diverged:
            norm = f" (grad norm {float(self.grad_norm):.4g})" if self.grad_norm is not None else ""
            kept = f"; the last checkpoint is step {self.last_saved_step}" if self.last_saved_step is not None else ""
            raise TrainingDiverged(
                f"training diverged at step {self.step}: the training loss or gradient norm is not "
                f"finite{norm}; nothing was saved from this step on{kept}; lower --lr or clip with "
                "--max-grad-norm"
            )
        return save, stop

    def request_save(self) -> None:
        self.save_requested = True

    def request_stop(self, stop: Stop) -> None:
        if self.stop_requested is None or (stop.finish and not self.stop_requested.finish):
            self.stop_requested = stop

    def request_export(self, weights) -> None:
        self.export = weights

    def attach(self, path) -> None:
        self.attached.append(path)

    def end_early(self, stop: Stop) -> None:
        """Training ends after this step, for ``stop``'s reason (the processes agreed on it)."""
        self.stop = stop

    def checkpointed(self, step: int | None) -> None:
        """The newest checkpoint is of ``step`` (for the divergence message)."""
        self.last_saved_step = step

    # ---- the training loss

    def loss_window(self) -> torch.Tensor:
        """(loss sum, count) of the open training-log window, summed over processes (a collective)."""
        return self.accelerator.reduce(
            torch.stack([self.loss_sum, self.loss_sum.new_tensor(float(self.loss_count))]), "sum"
        )

    def take_train_loss(self) -> float:
        totals = self.loss_window()
        self.loss_sum.zero_()
        self.loss_count = 0
        self.train_loss, self.train_loss_step = (totals[0] / totals[1]).item(), self.step
        return self.train_loss

    def final_train_loss(self) -> float | None:
        """summary.json's train loss: the latest window's, closing the one an early finish left open."""
        if self.train_loss_step != self.step:
            self.take_train_loss()
        return self.train_loss

    # ---- evaluation

    def eval_started(self) -> None:
        self.last_eval_started = time.perf_counter()

    def record_eval(self, metrics: dict, primary: str, higher_is_better: bool) -> None:
        """Keep an evaluation's metrics and duration, and whether its primary metric beat every earlier one."""
        self.last_eval_seconds = time.perf_counter() - self.last_eval_started
        key = f"eval_{primary}"
        if key not in metrics:
            raise ConfigError(
                f"the task's primary_metric {primary!r} is not among its eval metrics "
                f"({', '.join(m.removeprefix('eval_') for m in metrics)}): set primary_metric to one of them"
            )
        self.last_eval_step = self.step
        self.run_state.last_eval = metrics
        self.eval_improved = _improves(metrics[key], self.run_state.best_metric, higher_is_better)
        if self.eval_improved:
            self.run_state.best_metric = metrics[key]

    # ---- what a checkpoint records (the checkpointer's TrainerState)

    def layout(self) -> RunState:
        """What a checkpoint records of the data and layout it trained on: what a resume must keep (seed, data),
        or map onto another process count."""
        return RunState(
            seed=self.cfg.seed,
            global_batch_size=self.global_batch_size,
            grad_accum=self.cfg.grad_accum,
            train_samples=self.train_samples,
            data_fingerprint=self.data_fingerprint,
            num_processes=self.accelerator.num_processes,
            batches_per_epoch=self.batches_per_epoch,
        )

    def snapshot(self) -> RunState:
        """The state as a checkpoint records it now (a collective: the open training-loss window, summed over
        processes). After an epoch's last batch it points at the next epoch's start."""
        window = self.loss_window()
        epoch, position = self.run_state.epoch, self.run_state.batch_in_epoch
        if self.epoch_ended():
            epoch, position = epoch + 1, 0
        layout = {field: getattr(self.layout(), field) for field in LAYOUT_FIELDS}
        return dataclasses.replace(
            self.run_state,
            epoch=epoch,
            batch_in_epoch=position,
            train_seconds=self.elapsed(),
            loss_sum=window[0].item(),
            loss_count=window[1].item(),
            config=self.cfg.to_dict(),
            **layout,
        )

    def restore(self, state: RunState) -> None:
        """Continue from a checkpoint's state (the checkpointer has loaded everything else)."""
        self.run_state = state
        self.train_loss_step = self.last_saved_step = state.step
        if self.accelerator.is_main_process:  # the window's sum over all processes, counted once
            self.loss_sum.fill_(state.loss_sum)
            self.loss_count = state.loss_count

    def step_boundary(self) -> RunState:
        """:meth:`snapshot` as of the last optimizer step (less the open window's micro-batches), for a live peer."""
        self.run_state.batch_in_epoch -= self.window_drawn
        try:
            return self.snapshot()
        finally:
            self.run_state.batch_in_epoch += self.window_drawn

    def heal(self, state: RunState) -> None:
        """Continue from a live peer's :meth:`step_boundary`: before training, as a resume; inside a window only
        from a peer at this place (a group whose last step did not commit)."""
        here = (self.run_state.epoch, self.run_state.batch_in_epoch - self.window_drawn)
        if self.window_drawn and (state.epoch, state.batch_in_epoch) != here:
            raise RuntimeError(f"cannot heal inside a step from a peer at {state.epoch, state.batch_in_epoch}: {here}")
        state.batch_in_epoch += self.window_drawn
        self.run_state, self.train_loss_step = state, state.step
        self.loss_sum.fill_(state.loss_sum)
        self.loss_count = state.loss_count


LAYOUT_FIELDS = (
    "seed",
    "global_batch_size",
    "grad_accum",
    "train_samples",
    "data_fingerprint",
    "num_processes",
    "batches_per_epoch",
)
_END = object()  # the end of an epoch's batches: no value a loader or collate function can return


def _improves(value: float, best: float | None, higher_is_better: bool) -> bool:
    if value != value:  # NaN is never the best
        return False
    if best is None:
        return True
    return value > best if higher_is_better else value < best
