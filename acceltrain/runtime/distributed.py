"""Process-group set-up that cannot silently fall back, and the pieces PyTorch lacks on CPU.

Accelerate on a machine without CUDA, launched as N processes without being told it is on CPU,
reports ``DistributedType.NO`` with 1 process in each: N independent runs and no error. The toolkit
passes ``cpu=True`` when no accelerator is present (so a ``MULTI_GPU`` config launched by torchrun
becomes ``MULTI_CPU`` over gloo), and refuses to train when the launcher started more processes than
Accelerate joined.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
from accelerate.utils import DistributedType
from torch import nn

from acceltrain.config.options import ConfigError, parse_json, read_small_file, shorten
from acceltrain.config.train_config import TrainConfig
from acceltrain.runtime.accelerate_compat import skip_deepspeed_shm_op

T = TypeVar("T")


def use_cpu(force_cpu: bool) -> bool:
    """True when training must run on CPU: asked for, or no accelerator (CUDA, XPU, MPS, ...) present."""
    if force_cpu or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"):
        return True
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        return False  # Accelerate drops DeepSpeed under cpu=True; DeepSpeed picks its own CPU accelerator
    return not _accelerator_present()


def _accelerator_present() -> bool:
    accelerator_api = getattr(torch, "accelerator", None)
    if accelerator_api is not None:
        return accelerator_api.is_available()
    return torch.cuda.is_available()


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

            one_cpu_process = int(os.environ.get("WORLD_SIZE", "1")) == 1 and not _accelerator_present()
            if one_cpu_process and requested_engine() == DistributedType.DEEPSPEED:
                skip_deepspeed_shm_op()
    return PartialState(cpu=use_cpu(cpu))


def close_process_group() -> None:
    """Destroy the process group (every group of this process), then let go of them
    (:func:`forget_destroyed_groups`)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    forget_destroyed_groups()


def forget_destroyed_groups() -> None:
    """Once every process group is destroyed, drop the references to them that torch's ``DeviceMesh`` (its
    ``_pg_registry``) and FSDP2's mesh infos (``shard_process_group``, ...) keep, wherever they are: the user's
    model, which outlives the run, holds both, and DTensor's caches hold meshes. ``destroy_process_group`` only
    forgets the groups by name; a group still referred to keeps its gloo threads (2 per group, 1 for its TCP
    device) to the interpreter's exit, and a process that exits so while another still runs can abort
    ("terminate called without an active exception", SIGABRT) after a successful run. Torch alone shows it:
    ``fully_shard``, one step, ``destroy_process_group``, rank 0 leaving 0.5 s after rank 1: rank 1 aborted in 2 of
    32 launches here, in none of 32 with this. Nothing can use a destroyed group: a collective on such a model fails
    either way."""
    if not dist.is_available() or dist.is_initialized():
        return
    holders = tuple(
        cls
        for module, name in (
            ("torch.distributed.device_mesh", "DeviceMesh"),
            ("torch.distributed.fsdp._fully_shard._fsdp_common", "DataParallelMeshInfo"),
        )
        if isinstance(cls := getattr(sys.modules.get(module), name, None), type)
    )
    if not holders:  # neither imported: nothing of the kind exists
        return
    for holder in gc.get_objects():
        if not issubclass(type(holder), holders):
            continue
        for name, value in list(vars(holder).items()):
            if isinstance(value, dist.ProcessGroup):
                setattr(holder, name, None)
            elif isinstance(value, dict):
                for key in [key for key, item in value.items() if isinstance(item, dist.ProcessGroup)]:
                    del value[key]


ASYNC_UNDER_DEEPSPEED = (
    "--async-checkpoint works under DDP and FSDP; DeepSpeed writes its checkpoints itself: drop the flag"
)


def init_process_state(cfg: TrainConfig):
    """Create Accelerate's shared ``PartialState`` once, with the CPU decision, and check that every
    launched process joined it and that the hardware can do what ``cfg`` asks."""
    die_with_launcher()

    engine = requested_engine()
    if cfg.optimizer == "muon" and engine:  # before the process group: DeepSpeed's start-up takes minutes on a CPU
        raise ConfigError(
            f"--optimizer muon needs every weight matrix whole on each process, and {ENGINES[engine]} flattens or "
            "shards them: use DDP (multi_gpu.yaml, multi_cpu.yaml) or one process, or --optimizer sgd / adamw"
        )
    if cfg.async_checkpoint and engine == DistributedType.DEEPSPEED:
        raise ConfigError(ASYNC_UNDER_DEEPSPEED)
    on_cpu = use_cpu(cfg.cpu)
    precision = cfg.mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if precision == "fp16" and on_cpu:
        raise ConfigError(
            "--mixed-precision fp16 needs a CUDA GPU and this run is on CPU: use --mixed-precision bf16 or no"
        )
    state = process_state(cpu=on_cpu)
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


ENGINES = {
    DistributedType.DEEPSPEED: "DeepSpeed",
    DistributedType.FSDP: "FSDP",
}  # the sharding engines; the rest is "DDP"
_REQUESTED_BACKENDS = {
    "ACCELERATE_USE_FSDP": DistributedType.FSDP,
    "ACCELERATE_USE_DEEPSPEED": DistributedType.DEEPSPEED,
}


def requested_engine() -> DistributedType | None:
    """The sharding engine that ``accelerate launch`` asks for (in its environment), known before any process group."""
    return next(
        (
            backend
            for variable, backend in _REQUESTED_BACKENDS.items()
            if os.environ.get(variable, "").lower() == "true"
        ),
        None,
    )


def check_backend_honoured(distributed_type) -> None:
    """Refuse to train when the accelerate config asked for FSDP or DeepSpeed and Accelerate quietly set up
    something else (on CPU it drops FSDP for plain DDP, or runs N independent copies)."""
    backend = requested_engine()
    if backend is not None and distributed_type != backend:
        raise ConfigError(
            f"the accelerate config asks for {backend.value} but Accelerate set up {distributed_type.value} here "
            f"({'no GPU' if use_cpu(False) else 'check the config'}); refusing to fall back silently: "
            f"use a GPU machine or a config without {backend.value} (accelerate_configs/multi_cpu.yaml on CPU)"
        )


# --------------------------------------------------------------------------- DeepSpeed: one source of truth

_DEEPSPEED_OWNED = {
    "train_micro_batch_size_per_gpu": "--batch-size",
    "gradient_accumulation_steps": "--grad-accum",
    "train_batch_size": "--batch-size x --grad-accum x processes",
    "gradient_clipping": "--max-grad-norm",
}


def deepspeed_plugin(cfg: TrainConfig):
    """The DeepSpeed plugin on :func:`deepspeed_config`'s JSON; None when the launch is not a DeepSpeed one."""
    config = deepspeed_config(cfg)
    if config is None:
        return None
    from accelerate.utils import DeepSpeedPlugin

    return DeepSpeedPlugin(
        hf_ds_config=config,
        gradient_accumulation_steps=cfg.grad_accum,
        gradient_clipping=cfg.max_grad_norm or 0.0,
        zero3_init_flag=os.environ.get("ACCELERATE_DEEPSPEED_ZERO3_INIT", "false").lower() == "true",
    )


def deepspeed_config(cfg: TrainConfig) -> dict | None:
    """The DeepSpeed JSON of a DeepSpeed launch, resolved from the toolkit config: every ``"auto"`` the toolkit
    owns is filled (micro batch, accumulation, global batch, clipping, bf16/fp16), and a JSON value that
    contradicts the toolkit config is a one-line error naming both, before Accelerate resolves anything
    its own way (accelerate#2210, #2298). A JSON that is not an object, a section that is not one or a ZeRO stage
    outside 0-3 is one line too, where DeepSpeed would raise an AttributeError or ValidationError on rank 0 only.
    None when the launch is not a DeepSpeed one."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() != "true":
        return None
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if path == "none":
        raise ConfigError(
            "the accelerate config asks for DeepSpeed without deepspeed_config_file: use "
            "accelerate_configs/deepspeed_zero{2,3}.yaml"
        )
    try:
        config = parse_json(read_small_file(path, "DeepSpeed config"))
    except ValueError as err:
        raise ConfigError(f"DeepSpeed config {path!r} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ConfigError(
            f"DeepSpeed config {path!r} must be a JSON object of setting: value, not a {type(config).__name__}"
        )
    stage = _section(config, "zero_optimization", path).get("stage", "auto")
    if stage != "auto" and (type(stage) is not int or not 0 <= stage <= 3):
        raise ConfigError(
            f"DeepSpeed config {path!r}: zero_optimization.stage {shorten(stage)} is invalid: must be 0, 1, 2 or 3 "
            '(the ZeRO stage) or "auto"'
        )
    for section in ("optimizer", "scheduler"):
        if section in config:
            raise ConfigError(
                f"DeepSpeed config {path!r} defines an {section}: acceltrain builds it from the flags; remove that "
                "section"
            )
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    wanted = {
        "train_micro_batch_size_per_gpu": cfg.batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "train_batch_size": cfg.batch_size * cfg.grad_accum * processes,
        "gradient_clipping": cfg.max_grad_norm or 0.0,
    }
    for key, value in wanted.items():
        current = config.get(key, "auto")
        if current != "auto" and not _same_number(current, value):
            raise ConfigError(
                f"DeepSpeed config {path!r} sets {key}={shorten(current)} but {_DEEPSPEED_OWNED[key]} gives {value}: "
                'set it to "auto" or make them agree'
            )
        config[key] = value
    precision = cfg.mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    for name in ("bf16", "fp16"):
        enabled = _section(config, name, path).get("enabled", "auto")
        if enabled != "auto" and bool(enabled) != (precision == name):
            raise ConfigError(
                f"DeepSpeed config {path!r} sets {name}.enabled={shorten(enabled)} but --mixed-precision is "
                f'{precision}: set it to "auto" or make them agree'
            )
        config.setdefault(name, {})["enabled"] = precision == name
    return config


def _section(config: dict, name: str, path: str) -> dict:
    """``config[name]``, a JSON object ({} when absent): DeepSpeed's pydantic models and our ``.get`` take no other."""
    value = config.get(name, {})
    if not isinstance(value, dict):
        raise ConfigError(
            f"DeepSpeed config {path!r}: {name} {shorten(value)} is invalid: must be a JSON object {{...}}"
        )
    return value


def _same_number(given, wanted) -> bool:
    """Whether a JSON value equals the toolkit's number; a word or a list never does."""
    try:
        return float(given) == float(wanted)
    except (TypeError, ValueError):
        return False
