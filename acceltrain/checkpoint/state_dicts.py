"""What a checkpoint holds of the model and the optimizer: one builder for both writers, so that a synchronous
and an asynchronous save differ only in when the bytes reach the disk, never in which bytes.

The layout is Accelerate's own (``load_state`` reads it, and checkpoints written by ``save_state`` before this
builder still load):

- one process or DDP: ``model.safetensors`` (the plain module's names: no ``module.`` prefix; weights a model
  ties saved once, as ``save_state`` does) and ``optimizer.bin``, written by the main process;
- FSDP with sharded state dicts: DCP folders ``pytorch_model_fsdp_0/`` and ``optimizer_0/``, each process
  writing its shards (each with a save planner of its own: DCP caches plans by the planner's class name);
- DeepSpeed, and FSDP with full state dicts: the engine writes its own files (synchronously only).

An adapter run's model part holds its trainable weights alone (:mod:`.adapters`).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any

from accelerate.utils import DistributedType
from torch.distributed.checkpoint import DefaultSavePlanner

from acceltrain.runtime.accelerate_compat import FSDP_MODEL_NAME, MODEL_NAME, OPTIMIZER_NAME, SAFE_WEIGHTS_NAME
from acceltrain.runtime.distributed import ENGINES

SAFETENSORS, PICKLE, SHARDS, ENGINE = "safetensors", "pickle", "shards", "engine"
SHARDED_MODEL, SHARDED_OPTIMIZER = f"{FSDP_MODEL_NAME}_0", f"{OPTIMIZER_NAME}_0"  # FSDP's DCP folders


class ModelSavePlanner(DefaultSavePlanner):
    """DCP's planner for the model's shards; a class of its own, so that its cached plan is the model's."""


class OptimizerSavePlanner(DefaultSavePlanner):
    """DCP's planner for the optimizer's shards (sharing one cache with the model's ended runs at the 2nd save)."""


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


def engine_name(accelerator) -> str:
    """ "DDP" (whole state dicts: DDP and one process), "FSDP" or "DeepSpeed": what a checkpoint records it was
    written by, since each engine's files load only under that engine."""
    return ENGINES.get(accelerator.distributed_type, "DDP")


def writes_whole_copy(accelerator) -> bool:
    """Whether this engine's parts can be copied and written later (an asynchronous save): not when the engine
    writes its own files at the save (DeepSpeed, FSDP's full state dicts)."""
    return not any(part.form == ENGINE for part in _engine_parts(accelerator, None, None))


def checkpoint_parts(accelerator, model, optimizer, frozen: frozenset[str]) -> list[Part]:
    """This process's parts of the model and optimizer state, as live tensors (a writer copies what it keeps);
    ``frozen``: the state-dict names an adapter run leaves out."""
    engine_parts = _engine_parts(accelerator, model, optimizer)
    if engine_parts:
        return engine_parts
    if accelerator.distributed_type == DistributedType.FSDP:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        return [
            Part(SHARDED_MODEL, {"model": get_model_state_dict(model)}, SHARDS, ModelSavePlanner),
            Part(
                SHARDED_OPTIMIZER,
                {"optimizer": get_optimizer_state_dict(model, optimizer.optimizer)},
                SHARDS,
                OptimizerSavePlanner,
            ),
        ]
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


def _engine_parts(accelerator, model, optimizer) -> list[Part]:
    """The parts an engine writes itself, at the save, on every process."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return [Part(MODEL_NAME, lambda folder: model.save_checkpoint(str(folder), MODEL_NAME), ENGINE)]
    if accelerator.distributed_type == DistributedType.FSDP and "SHARDED" not in str(
        accelerator.state.fsdp_plugin.state_dict_type
    ):
        from accelerate.utils import save_fsdp_model, save_fsdp_optimizer

        def write(folder) -> None:
            save_fsdp_model(accelerator.state.fsdp_plugin, accelerator, model, str(folder))
            save_fsdp_optimizer(accelerator.state.fsdp_plugin, accelerator, optimizer, model, str(folder))

        return [Part(FSDP_MODEL_NAME, write, ENGINE)]
    return []
