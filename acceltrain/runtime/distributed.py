"""Process-group set-up that cannot silently fall back, and the pieces PyTorch lacks on CPU.

Accelerate on a machine without CUDA, launched as N processes without being told it is on CPU,
reports no distributed set-up (``NO``) with 1 process in each: N independent runs and no error. The toolkit
passes ``cpu=True`` when no accelerator is present (so a ``MULTI_GPU`` config launched by torchrun
becomes ``MULTI_CPU`` over gloo), and refuses to train when the launcher started more processes than
Accelerate joined.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

from acceltrain.accelerate_compat import skip_deepspeed_shm_op
from acceltrain.config.options import ConfigError
from acceltrain.config.train_config import TrainConfig
from acceltrain.engines import DeepSpeed, launch_engine, requested, use_cpu
from acceltrain.engines.base import accelerator_present, forget_destroyed_groups

T = TypeVar("T")


def die_with_launcher() -> None:
    """A worker started by torchrun (or ``accelerate launch``, which runs it) ends when its launcher dies. A
    launcher that is alive stops its workers itself (SIGTERM, then SIGKILL after 30 s); one killed outright
    (SIGKILL, a job step's or a test's timeout) cannot, and a worker waiting in a collective would then wait for
    good. Linux's ``PR_SET_PDEATHSIG``; elsewhere nothing changes."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


def process_state(cpu: bool = False):
    """Accelerate's shared ``PartialState`` (the first call joins the process group, on CPU where ``cpu`` asks or
    no accelerator is present: the shipped multi-CPU config launches as MULTI_GPU, and a ``PartialState()`` there
    would leave each process alone), with the modules that would pin that group imported before it exists.

    torch.distributed.nn's functions and DeepSpeed's ``TorchBackend`` (which Accelerate's ``unwrap_model`` imports
    when DeepSpeed is installed) take the default group as a default argument, evaluated on import: imported after
    the group is created, they keep it and its gloo threads alive past ``destroy_process_group``, and a process that
    exits while another still runs can then abort ("terminate called without an active exception") after a
    successful run. Imported before, their default is None."""
    from accelerate import PartialState
    from accelerate.utils import is_deepspeed_available

    if not dist.is_initialized():
        import torch.distributed.nn  # noqa: F401

        if is_deepspeed_available():
            import deepspeed.comm  # noqa: F401

            one_cpu_process = int(os.environ.get("WORLD_SIZE", "1")) == 1 and not accelerator_present()
            if one_cpu_process and requested() is DeepSpeed:
                skip_deepspeed_shm_op()
    return PartialState(cpu=use_cpu(cpu))


def close_process_group() -> None:
    """Destroy the process group (every group of this process), then let go of them
    (:func:`forget_destroyed_groups`)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    forget_destroyed_groups()


def init_process_state(cfg: TrainConfig, task=None):
    """Create Accelerate's shared ``PartialState`` once, with the CPU decision, and check that every
    launched process joined it and that the hardware can do what ``cfg`` asks; what the launch's engine cannot run
    (``cfg``, a ``task``) is one line before the process group exists."""
    die_with_launcher()
    launch_engine().refuse(cfg, task)
    on_cpu = use_cpu(cfg.cpu)
    precision = cfg.mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if precision == "fp16" and on_cpu:
        raise ConfigError(
            "--mixed-precision fp16 needs a CUDA GPU and this run is on CPU: use --mixed-precision bf16 or no"
        )
    state = process_state(cpu=on_cpu)
    launch_engine().process_state_ready(state)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and state.num_processes != launched:
        raise ConfigError(
            f"the launcher started WORLD_SIZE={launched} processes but Accelerate joined {state.num_processes} "
            f"(distributed_type={state.distributed_type.value}): this would be {launched} independent runs; "
            "check the accelerate config (DeepSpeed needs a GPU for more than one process)"
        )
    return state


def on_main_process_first(work: Callable[[], T]) -> T:
    """``work()`` on the main process, then on the others, which find what it wrote (downloads, cache
    files, a tokenizer). Accelerate's ``main_process_first`` leaves the other processes waiting at its
    barrier for good when the main one raises; here every process always reaches the barrier, and then
    all of them fail when any did: with the main process's one-line ConfigError when that was the cause."""
    from accelerate.utils import gather_object

    state = process_state()
    failure: BaseException | None = None
    with state.main_process_first():
        try:
            result = work()
        except Exception as err:  # noqa: BLE001 - re-raised below, after the barrier
            failure = err
    if state.num_processes > 1:
        reports = gather_object([None if failure is None else (type(failure) is ConfigError, str(failure))])
        first = next((report for report in reports if report is not None), None)
        if failure is None and first is not None:
            is_config_error, message = first
            failure = ConfigError(message) if is_config_error else RuntimeError(f"another process failed: {message}")
    if failure is not None:
        raise failure
    return result


def main_process_only(work: Callable[[], None]) -> None:
    """``work()`` on the main process alone; a ConfigError it raises is raised on every process, so that
    none is left waiting at the next collective."""
    from accelerate.utils import broadcast_object_list

    state = process_state()
    error = [None]
    if state.is_main_process:
        try:
            work()
        except ConfigError as err:
            error[0] = str(err)
    if state.num_processes > 1:
        broadcast_object_list(error, from_process=0)
    if error[0] is not None:
        raise ConfigError(error[0])


def control_group():
    """A process group for control flags (:func:`any_process`): the default one when it is gloo, else a new gloo
    group over all processes (a collective: every process calls it at the same point)."""
    return None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


def any_process(*flags: bool, group=None) -> list[bool]:
    """Each flag true on any process (a collective), on the CPU over ``group`` (:func:`control_group`): a decision
    made per micro-batch must not wait for the device's queued work, as a flag on an NCCL group would."""
    values = torch.tensor(flags, dtype=torch.int32)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return [bool(value) for value in values.tolist()]


class _SumAcrossProcesses(torch.autograd.Function):
    """All-reduce (sum) whose backward all-reduces the gradient: each input feeds every process's output."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        total = tensor.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class CrossProcessBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm whose training statistics cover the global batch of all processes, on any backend.

    ``torch.nn.SyncBatchNorm`` refuses CPU tensors (gloo), so DDP on CPU would normalise each process's
    half-batch separately and differ from one process at twice the batch. This sums the count, the sum and
    the squared deviations across processes with a differentiable all-reduce; on one process it is plain BatchNorm.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        channels = x.shape[1]
        dims = [0, 2, 3]
        # Two passes (mean, then squared deviations) match single-process BatchNorm to float precision.
        count_and_sum = torch.cat([x.new_tensor([x.numel() / channels]), x.sum(dims)])
        count_and_sum = _SumAcrossProcesses.apply(count_and_sum)
        count, mean = count_and_sum[0], count_and_sum[1:] / count_and_sum[0]
        centred = x - mean.view(1, channels, 1, 1)
        var = _SumAcrossProcesses.apply((centred * centred).sum(dims)) / count
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.lerp_(mean.detach(), momentum)
                self.running_var.lerp_(var.detach() * count / (count - 1), momentum)
        shape = (1, channels, 1, 1)
        y = centred * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y


def convert_sync_batchnorm(model: nn.Module, on_cpu: bool) -> nn.Module:
    """Global-batch BatchNorm under DDP: torch's SyncBatchNorm on accelerators, ours on CPU."""
    if not on_cpu:
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    for name, child in model.named_children():
        if isinstance(child, nn.BatchNorm2d) and not isinstance(child, CrossProcessBatchNorm2d):
            replacement = CrossProcessBatchNorm2d(
                child.num_features, child.eps, child.momentum, child.affine, child.track_running_stats
            )
            # Keep the very same Parameter objects: an optimizer built before the conversion still owns them.
            if child.affine:
                replacement.weight, replacement.bias = child.weight, child.bias
            if child.track_running_stats:
                replacement.running_mean = child.running_mean
                replacement.running_var = child.running_var
                replacement.num_batches_tracked = child.num_batches_tracked
            replacement.train(child.training)
            setattr(model, name, replacement)
        else:
            convert_sync_batchnorm(child, on_cpu)
    return model
