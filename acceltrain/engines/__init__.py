"""The engines, one module each, and their registry: which engine a launch asks for (before the process group), which
one a run's accelerator is, and which one wrote a checkpoint. Only this package and the Accelerate compat module know
Accelerate's ``DistributedType``."""

from __future__ import annotations

import os

from acceltrain.config.options import ConfigError
from acceltrain.engines.base import Engine, accelerator_present
from acceltrain.engines.ddp import DDP
from acceltrain.engines.deepspeed import DeepSpeed
from acceltrain.engines.fsdp2 import FSDP2
from acceltrain.engines.one_process import OneProcess
from acceltrain.engines.torchft import TorchFT

ENGINES: tuple[type[Engine], ...] = (OneProcess, DDP, FSDP2, DeepSpeed, TorchFT)
CHECKPOINT_FORMATS = tuple(dict.fromkeys(engine.checkpoint_format for engine in ENGINES))


def requested() -> type[Engine] | None:
    """The engine ``accelerate launch`` asks for in its environment (FSDP, DeepSpeed), known before any process
    group; None for DDP or one process, which the process count tells."""
    return next(
        (
            engine
            for engine in ENGINES
            if engine.launch_variable and os.environ.get(engine.launch_variable, "").lower() == "true"
        ),
        None,
    )


def launch_engine() -> type[Engine]:
    """The engine this launch runs: the one it asks for, else DDP over several processes, else one process."""
    return requested() or (DDP if int(os.environ.get("WORLD_SIZE", "1")) > 1 else OneProcess)


def writer_of(checkpoint_format: str) -> type[Engine]:
    """The engine whose checkpoints are of ``checkpoint_format`` (what a checkpoint's trainer_state.json records)."""
    return next(engine for engine in ENGINES if engine.checkpoint_format == checkpoint_format)


def engine_of(accelerator) -> Engine:
    """The engine of a built accelerator; one line when it is not the one the launch asked for (Accelerate drops
    FSDP on CPU for plain DDP, or runs N independent copies, without a word)."""
    wanted = requested()
    if wanted is not None and accelerator.distributed_type in wanted.distributed_types:
        return wanted(accelerator)  # torchft's groups are each one process
    engine = next((cls for cls in ENGINES if accelerator.distributed_type in cls.distributed_types), None)
    if wanted is not None and engine is not wanted:
        shown = accelerator.distributed_type.value
        raise ConfigError(
            f"the accelerate config asks for {wanted.distributed_types[0].value} but Accelerate set up {shown} here "
            f"({'no GPU' if use_cpu(False) else 'check the config'}); refusing to fall back silently: use a GPU "
            f"machine or a config without {wanted.distributed_types[0].value} (accelerate_configs/multi_cpu.yaml on "
            "CPU)"
        )
    if engine is None:
        raise ConfigError(f"Accelerate set up {accelerator.distributed_type.value}, which no acceltrain engine runs")
    return engine(accelerator)


def use_cpu(force_cpu: bool) -> bool:
    """True when training must run on CPU: asked for, or no accelerator present (an engine that runs on the CPU by
    itself, DeepSpeed, is not told)."""
    if force_cpu or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"):
        return True
    engine = requested()
    if engine is not None and not engine.takes_cpu_flag:
        return False
    return not accelerator_present()


__all__ = [
    "CHECKPOINT_FORMATS",
    "DDP",
    "ENGINES",
    "FSDP2",
    "DeepSpeed",
    "Engine",
    "OneProcess",
    "TorchFT",
    "engine_of",
    "launch_engine",
    "requested",
    "use_cpu",
    "writer_of",
]
