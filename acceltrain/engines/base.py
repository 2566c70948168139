"""What an engine is to the toolkit: everything one way of running a model across processes means, in one class
(as Lightning Fabric's ``Strategy``; torchtitan puts each checkpoint backend behind one small base class). How the
launch asks for it, what it refuses before the process group exists, the accelerator it builds, what it does to the
model around ``Accelerator.prepare``, the checkpoint parts it writes and what it checks before loading them. The
loop, the checkpointer and the hooks ask the run's engine; none of them tells one engine from another.

A new engine is a module in this package with a subclass of :class:`Engine`, and its line in the registry
(:data:`acceltrain.engines.ENGINES`)."""

from __future__ import annotations

import dataclasses
import gc
import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, ClassVar

from torch import nn

from acceltrain.accelerate_compat import OPTIMIZER_NAME, SAFE_WEIGHTS_NAME
from acceltrain.config.options import ConfigError

SAFETENSORS, PICKLE, SHARDS, ENGINE = "safetensors", "pickle", "shards", "engine"  # how a checkpoint part is written


@dataclasses.dataclass
class Part:
    """One file or folder of a checkpoint: ``state`` written as ``form`` at ``name`` (``ENGINE``: by ``state``'s own
    writer, a callable taking the folder)."""

    name: str
    state: Any
    form: str
    planner: type | None = None  # SHARDS: the DCP save planner's class
    # the state's keys that training changes before the next optimizer step (buffers: BatchNorm's statistics change
    # in every training forward); the rest (weights, optimizer state) changes only at that step
    changes_before_step: frozenset[str] = frozenset()


class Engine:
    """One engine. The class answers before the process group (from the launch's settings); an instance, bound to the
    run's accelerator, for the rest of the run."""

    name: ClassVar[str]  # in messages and the start-up log
    checkpoint_format: ClassVar[str]  # what trainer_state.json records: a checkpoint loads under its format only
    distributed_types: ClassVar[tuple] = ()  # Accelerate's DistributedType values this engine is
    launch_variable: ClassVar[str | None] = None  # what `accelerate launch` sets to "true" to ask for it
    takes_cpu_flag: ClassVar[bool] = True  # built with Accelerator(cpu=True) where the machine has no accelerator
    keeps_weight_matrices: ClassVar[bool] = True  # each process holds each weight matrix whole and unflattened (Muon)
    refusals: ClassVar[dict[str, str]] = {}  # what it cannot run, by setting: "async_checkpoint", "summed_losses", ...

    def __init__(self, accelerator):
        self.accelerator = accelerator

    # ---- before the process group

    @classmethod
    def refuse(cls, cfg, task=None) -> None:
        """One line for what the launch's settings ask and this engine cannot run, before the process group exists
        (DeepSpeed's start-up takes minutes on a CPU)."""
        if cfg.optimizer == "muon" and not cls.keeps_weight_matrices:
            raise ConfigError(
                f"--optimizer muon needs every weight matrix whole on each process, and {cls.name} flattens or "
                "shards them: use DDP (multi_gpu.yaml, multi_cpu.yaml) or one process, or --optimizer sgd / adamw"
            )
        for setting in ("async_checkpoint", "data_on_device"):
            if getattr(cfg, setting):
                cls.refuse_setting(setting)
        if getattr(task, "sums_losses", False):
            cls.refuse_setting("summed_losses")

    @classmethod
    def refuse_setting(cls, setting: str) -> None:
        """One line when this engine cannot run ``setting`` (a key of :attr:`refusals`)."""
        if setting in cls.refusals:
            raise ConfigError(cls.refusals[setting])

    @classmethod
    def process_state_ready(cls, state) -> None:
        """What the engine sets on Accelerate's shared ``PartialState`` once the process has joined it."""

    @classmethod
    def start(cls, cfg, **kwargs) -> Engine:
        """The run's accelerator, built as this engine needs it from ``cfg`` and Accelerate's other arguments, and the
        engine bound to it (one line when Accelerate set up another engine than the launch asked for)."""
        from acceltrain.engines import engine_of, use_cpu

        return engine_of(cls.build_accelerator(use_cpu(cfg.cpu), mixed_precision=cfg.mixed_precision, **kwargs))

    @classmethod
    def build_accelerator(cls, on_cpu: bool, **kwargs):
        return training_accelerator()(cpu=on_cpu, **kwargs)

    # ---- around Accelerator.prepare

    def before_prepare(self, model: nn.Module, optimizer) -> list[str]:
        """What the engine sets up on the model before ``prepare``; notes for the start-up log."""
        return []

    def after_prepare(self, model: nn.Module) -> list[str]:
        """What the engine sets up on the prepared model; notes for the start-up log."""
        return []

    def settings(self) -> dict:
        """The engine's resolved settings, for the run config and the summary."""
        return {}

    def holds_whole_weights(self) -> bool:
        """Whether every process holds every weight whole (EMA and Lookahead average them)."""
        return True

    def data_shard(self) -> tuple[int, int]:
        """Which share of each epoch's samples this process's copy of the run reads, and of how many, before
        Accelerate splits it between the processes: all of it, but for replica groups (torchft)."""
        return 0, 1

    # ---- the steps (an engine that steps by consensus between live peers, torchft, acts here; the others need not)

    def share_state(self, state_dict: Callable[[], dict], load_state_dict: Callable[[dict], int]) -> None:
        """How the run's state is read and set in memory (the checkpointer's), for an engine that heals a process
        from a live peer."""

    def join(self, step: int) -> None:
        """Once before training, at ``step`` (0, or a resume's): where a restarted process catches up with live
        peers."""

    def start_step(self, step: int) -> None:
        """At each optimizer step's first micro-batch (``step``: the steps done)."""

    def average_gradients(self, model: nn.Module) -> None:
        """The gradients averaged between the copies of the model, where backward has not done it (DDP, FSDP and
        DeepSpeed average in backward)."""

    def step_optimizer(self, optimizer) -> bool:
        """The optimizer step; whether it was taken (not skipped by the fp16 grad scaler)."""
        optimizer.step()
        return not self.accelerator.optimizer_step_was_skipped

    def figures(self) -> dict:
        """What the training log shows of the engine at each row."""
        return {}

    def training_ended(self, model: nn.Module, step: int) -> None:
        """The run trained to its end (not stopped to resume)."""

    def release(self) -> None:
        """Let go of what the engine holds outside the accelerator, however the run ended."""

    # ---- checkpoints

    def writes_checkpoints(self) -> bool:
        """Whether this process takes part in writing checkpoints (replica groups: only replica 0 writes)."""
        return True

    def checkpoint_parts(self, model, optimizer, frozen: frozenset[str]) -> list[Part]:
        """This process's parts of the model and optimizer state, as live tensors (a writer copies what it keeps);
        ``frozen``: the state-dict names an adapter run leaves out. Here whole state dicts, written by the main
        process: ``model.safetensors`` (the plain module's names, weights a model ties saved once) and
        ``optimizer.bin``."""
        accelerator = self.accelerator
        if not accelerator.is_main_process:
            return []
        from accelerate.utils import clean_state_dict_for_safetensors

        plain = accelerator.unwrap_model(model)
        weights = OrderedDict((name, tensor) for name, tensor in plain.state_dict().items() if name not in frozen)
        weights = clean_state_dict_for_safetensors(weights)
        buffers = frozenset(name for name, _ in plain.named_buffers() if name in weights)
        return [
            Part(SAFE_WEIGHTS_NAME, weights, SAFETENSORS, changes_before_step=buffers),
            Part(f"{OPTIMIZER_NAME}.bin", optimizer.state_dict(), PICKLE),
        ]

    def load_parts(self, folder, model, optimizer, *, strict: bool = True) -> None:
        """Read back, on every process, what :meth:`checkpoint_parts` wrote into checkpoint ``folder`` (the
        checkpointer has verified it and loads without running code): the weights into the plain module (``strict``
        False for an adapter run's trainable weights alone), the optimizer state into the optimizer."""
        import torch
        from safetensors.torch import load_model

        load_model(self.accelerator.unwrap_model(model), str(folder / SAFE_WEIGHTS_NAME), strict=strict)
        optimizer.load_state_dict(torch.load(folder / f"{OPTIMIZER_NAME}.bin", map_location="cpu", weights_only=True))

    @classmethod
    def merged_weights(cls, checkpoint, out) -> dict:
        """The model weights of one of this engine's checkpoints, by name, on the CPU (``acceltrain merge``; ``out``,
        the new folder, may hold what merging needs to write)."""
        from safetensors.torch import load_file

        weights = load_file(str(checkpoint / SAFE_WEIGHTS_NAME))
        return {name.removeprefix("module."): tensor for name, tensor in weights.items()}

    def writes_own_files(self) -> bool:
        """Whether the engine writes its checkpoint files itself at the save, so that nothing can be copied and
        written later (an asynchronous save)."""
        return False

    def check_async_supported(self) -> None:
        self.refuse_setting("async_checkpoint")

    def sharded_model(self) -> str | None:
        """The DCP folder of a checkpoint that holds the model's shards, None for an engine that writes none."""
        return None

    def relayout_refusal(self, saved_processes: int, current_processes: int) -> str | None:
        """Why a checkpoint of this engine written on ``saved_processes`` cannot continue on ``current_processes``,
        or None when it can."""
        return None


def training_accelerator():
    """Accelerate's ``Accelerator``, its ``end_training`` followed by :func:`forget_destroyed_groups`."""
    from accelerate import Accelerator

    class TrainingAccelerator(Accelerator):
        def end_training(self):
            import torch.distributed as dist

            had_group = dist.is_available() and dist.is_initialized()
            super().end_training()
            if had_group:  # one process has none: nothing to let go of (and the search costs ~0.1 s)
                forget_destroyed_groups()

    return TrainingAccelerator


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
    import torch.distributed as dist

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


def parameters_held(model: nn.Module) -> dict[str, int]:
    """The model's parameters and how many of them this process holds: equal under DDP, about 1/N of each
    sharded tensor under FSDP (a DTensor's local shard) and DeepSpeed ZeRO-3 (its partition)."""
    total = held = 0
    for param in model.parameters():
        total += getattr(param, "ds_numel", param.numel())
        local = getattr(param, "ds_tensor", None)
        held += (
            local.numel()
            if local is not None
            else param.to_local().numel()
            if hasattr(param, "to_local")
            else param.numel()
        )
    return {"parameters": total, "parameters_per_process": held}


def accelerator_present() -> bool:
    """Whether this machine has an accelerator (CUDA, XPU, MPS, ...) torch can use."""
    import torch

    accelerator_api = getattr(torch, "accelerator", None)
    if accelerator_api is not None:
        return accelerator_api.is_available()
    return torch.cuda.is_available()
