"""Where training stands and how it advances: the loop's own state machine, which no hook touches.

It owns the :class:`~acceltrain.checkpoint.RunState` (what a checkpoint's ``trainer_state.json`` records), walks
each epoch's batches (a resume's rest of one included, a stream's passes agreed by every process), knows each
accumulation window, counts and times each optimizer step, keeps the training-loss window, and makes the one
agreement per optimizer step on whether to save, stop or give up on a diverged run. Hooks see it through
:class:`~acceltrain.train.run.Run`, and ask it for things (a save, a stop, an export) there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch
from accelerate.logging import get_logger

from acceltrain.accelerate_compat import mark_loader_finished
from acceltrain.checkpoint.state import RunState
from acceltrain.config.options import ConfigError
from acceltrain.runtime.distributed import any_process, control_group
from acceltrain.runtime.metrics import Throughput, synchronize
from acceltrain.runtime.preemption import EXIT_PREEMPTED, TrainingDiverged
from acceltrain.train.speed import to_channels_last

logger = get_logger(__name__)


@dataclasses.dataclass
class Stop:
    """Why the run ends early. ``finish``: as a finished run (weights, summary, exit 0), e.g. a target
    reached; otherwise checkpointed to be resumed, exiting with ``exit_code`` (75, or 130 after Ctrl-C)."""

    reason: str
    finish: bool = False
    exit_code: int = EXIT_PREEMPTED


class Progress:
    """The loop's state (see the module docstring). ``train_batches`` is the prepared training loader;
    ``batches_per_epoch`` 0 means a stream, whose passes end when the stream does."""

    def __init__(
        self,
        cfg,
        accelerator,
        train_batches,
        *,
        total_steps: int,
        batches_per_epoch: int,
        train_samples: int,
        data_fingerprint: str | None,
    ):
        self.cfg, self.accelerator, self.train_batches = cfg, accelerator, train_batches
        self.total_steps, self.batches_per_epoch, self.train_samples = total_steps, batches_per_epoch, train_samples
        self.data_fingerprint = data_fingerprint
        self.stream = batches_per_epoch == 0
        self.global_batch_size = cfg.batch_size * accelerator.num_processes  # of one micro-step
        self.control_group = (
            control_group() if self.stream and accelerator.num_processes > 1 else None
        )  # None: gloo's default
        self.state = RunState()
        self.pass_end = False  # a stream's current batch ends its pass (on every process)
        # the training-log window: micro-batches, or loss targets (tokens) for a task that returns (sum, count)
        self.loss_sum = torch.zeros((), device=accelerator.device)
        self.loss_count = 0
        self.window_targets = 0  # the open accumulation window's loss targets, for a task that returns (sum, count)
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
        return self.state.step

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
        self.started = self.launch_started - self.state.train_seconds
        self.throughput.resume(0)

    def elapsed(self) -> float:
        """Wall-clock seconds since the run's first step, earlier launches included (before this launch's
        first step: those of the earlier launches)."""
        if self.throughput is None:
            return self.state.train_seconds
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
        state, batches = self.state, self.train_batches
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
            batch = self._next_batch(iterator, resumed_at)
            if self.stream and self._agree_on_pass_ends(iterator, batch):
                break
            if batch is _END:
                break
            if (
                batch is None
            ):  # the loop's own end of an epoch was once None: a None from the user ended every epoch at once
                raise ConfigError(
                    "a training batch is None: the collate function returned nothing (a missing return?); it "
                    "must return a batch the task takes"
                )
            self.throughput.add_data_wait(time.perf_counter() - waited)
            state.batch_in_epoch += 1
            yield to_channels_last(batch) if self.cfg.channels_last else batch
            if self.pass_end:  # a stream's pass ends with this batch on every process
                self._leave_pass(iterator)
                break
        if not self.stream:  # a stream's pass ends in the loop, after on_epoch_end
            self.next_pass()

    def _next_batch(self, iterator, resumed_at: int):
        """The next batch, or :data:`_END` at the epoch's end. A resumed stream that ends before the checkpoint's place
        in it (the loader's fast-forward runs dry) held more data when the checkpoint was written."""
        try:
            return next(iterator)
        except StopIteration:
            return _END
        except RuntimeError as err:  # "generator raised StopIteration": Accelerate's loader around the fast-forward
            if not (self.stream and resumed_at and isinstance(err.__cause__, StopIteration)):
                raise
            raise ConfigError(
                f"the training stream ended before the checkpoint's place in it (batch {resumed_at} of pass "
                f"{self.state.epoch} on each process): it holds less data than when the checkpoint was written; "
                "restore it, or start a new --output-dir"
            ) from None

    def _agree_on_pass_ends(self, iterator, batch) -> bool:
        """Whether the stream's pass has ended before ``batch``; sets ``pass_end`` when it ends with it. On several
        processes all agree, once per micro-batch: a stream sharded unevenly (more samples on one process than
        on another) ends its pass everywhere with the first process's end, so that no process waits for good in
        a collective the others never reach."""
        self.pass_end = batch is _END or self.train_batches.end_of_dataloader
        if self.accelerator.num_processes == 1:
            return batch is _END
        missing, self.pass_end = any_process(batch is _END, self.pass_end, group=self.control_group)
        if self.pass_end and not self.train_batches.end_of_dataloader:  # ended by another process's stream
            mark_loader_finished(self.train_batches)  # a checkpoint taken from now on records a finished pass
        if missing and batch is not _END:  # another process has no batch left: this one drops its own
            self._leave_pass(iterator)
        return missing

    def _leave_pass(self, iterator) -> None:
        """End this process's pass of the stream: as the loader ends it, or, when another process's stream ended
        first, by leaving the rest untrained (a resume starts the next pass)."""
        if self.train_batches.end_of_dataloader:
            next(iterator, None)  # the loader has no batch left: let it finish its pass
            return
        iterator.close()
        self.train_batches.end()  # what the closed generator would have done at its end
        logger.warning(
            f"process {self.accelerator.process_index}: pass {self.state.epoch} of the training stream ended on "
            f"another process after {self.state.batch_in_epoch} batches; the rest of this process's pass is left "
            "out (the stream holds more samples here than there)",
            main_process_only=False,
        )

    def epoch_ended(self) -> bool:
        """Whether the batch just trained was its epoch's last (a stream's: as all processes agreed)."""
        if self.stream:
            return self.pass_end
        return self.state.batch_in_epoch == self.batches_per_epoch

    def next_pass(self) -> None:
        self.state.epoch, self.state.batch_in_epoch = self.state.epoch + 1, 0

    @property
    def epoch_progress(self) -> float:
        """Epochs done, fractional: 1.5 is the middle of the second epoch."""
        if self.stream:  # complete passes: a pass's length is not known before its end
            return float(self.state.epoch + bool(self.state.batch_in_epoch and self.epoch_ended()))
        return round(self.state.epoch + self.state.batch_in_epoch / self.batches_per_epoch, 4)

    # ---- the steps

    def window(self) -> tuple[bool, int]:
        """Whether the current micro-batch opens an accumulation window, and the window's length: grad_accum,
        or fewer for an epoch's last window; a stream's windows run across its passes' ends."""
        accum = self.cfg.grad_accum
        if self.stream:  # Accelerate's count of micro-batches, never reset by a pass's end
            return self.accelerator.step % accum == 0, accum
        position = self.state.batch_in_epoch
        start = (position - 1) // accum * accum
        return start == position - 1, min(accum, self.batches_per_epoch - start)

    def step_done(self, micro_batches: int) -> None:
        """Count and time the optimizer step just taken, and note on the device (no sync) whether its loss or
        gradient norm is non-finite; a grad-scaler skip (fp16 overflow) is not divergence."""
        self.state.step += 1
        samples = micro_batches * self.global_batch_size
        self.state.samples_seen += samples
        self.throughput.step_done(self.step - self.launch_start_step, samples)
        diverged = ~torch.isfinite(self.loss_sum)
        if self.grad_norm is not None and not self.accelerator.optimizer_step_was_skipped:
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

    def request_stop(self, stop: Stop) -> None:
        if self.stop_requested is None or (stop.finish and not self.stop_requested.finish):
            self.stop_requested = stop

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

    def record_eval(self, metrics: dict, primary: str, higher_is_better: bool) -> None:
        """Keep an evaluation's metrics, and whether its primary metric beat every earlier one."""
        key = f"eval_{primary}"
        if key not in metrics:
            raise ConfigError(
                f"the task's primary_metric {primary!r} is not among its eval metrics "
                f"({', '.join(m.removeprefix('eval_') for m in metrics)}): set primary_metric to one of them"
            )
        self.last_eval_step = self.step
        self.state.last_eval = metrics
        self.eval_improved = _improves(metrics[key], self.state.best_metric, higher_is_better)
        if self.eval_improved:
            self.state.best_metric = metrics[key]

    # ---- what a checkpoint records (the checkpointer's TrainerState)

    def layout(self) -> RunState:
        """What a checkpoint records of the data and layout it trained on: what a resume must keep (seed, data),
        or map onto another process count."""
        processes = self.accelerator.num_processes
        return RunState(
            seed=self.cfg.seed,
            global_batch_size=self.cfg.batch_size * processes,
            grad_accum=self.cfg.grad_accum,
            train_samples=self.train_samples,
            data_fingerprint=self.data_fingerprint,
            num_processes=processes,
            batches_per_epoch=self.batches_per_epoch,
        )

    def snapshot(self) -> RunState:
        """The state as a checkpoint records it now (a collective: the open training-loss window, summed over
        processes). After an epoch's last batch it points at the next epoch's start."""
        window = self.loss_window()
        epoch, position = self.state.epoch, self.state.batch_in_epoch
        if self.epoch_ended():
            epoch, position = epoch + 1, 0
        layout = {field: getattr(self.layout(), field) for field in LAYOUT_FIELDS}
        return dataclasses.replace(
            self.state,
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
        self.state = state
        self.train_loss_step = self.last_saved_step = state.step
        if self.accelerator.is_main_process:  # the window's sum over all processes, counted once
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
