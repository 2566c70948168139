"""Every use of Accelerate's private parts (and the one DeepSpeed internal the toolkit changes), in one place. Each
says why the public API does not serve, and ``tests/test_accelerate_compat.py`` checks each against the installed
version, so that an upgrade that changes what one relies on fails there, by name, instead of somewhere deep in a
run."""

from __future__ import annotations

from pathlib import Path

from accelerate.utils import DistributedType

# the file and folder names Accelerate's save_state/load_state use (public constants, private layout)
from accelerate.utils.constants import FSDP_MODEL_NAME, MODEL_NAME, OPTIMIZER_NAME, SAFE_WEIGHTS_NAME  # noqa: F401


def save_loop_state(accelerator, folder: Path) -> None:
    """What ``save_state`` writes beside the model and optimizer: the RNG states, the loaders' positions (samplers,
    stateful loaders), the grad scaler and the micro-step count. The checkpointer writes the model and optimizer
    itself (one builder for its synchronous and asynchronous writers; Accelerate has no async save, accelerate#3746),
    so it calls the part of ``save_state`` that writes the rest: ``accelerate.checkpointing.save_accelerator_state``
    with no models, optimizers or schedulers, and ``Accelerator._dataloaders`` (no public accessor)."""
    from accelerate.checkpointing import save_accelerator_state

    save_accelerator_state(
        str(folder),
        [],
        [],
        [],
        accelerator._dataloaders,
        accelerator.process_index,
        accelerator.step,
        accelerator.scaler,
        save_on_each_node=accelerator.project_configuration.save_on_each_node,
    )


def load_loop_state(accelerator, folder: Path) -> None:
    """Read back what :func:`save_loop_state` wrote, with its reader: ``load_accelerator_state`` with no models,
    optimizers or schedulers (the engine loads the model and optimizer itself), and the micro-step count it returns
    (``load_state`` sets it so)."""
    from accelerate.checkpointing import load_accelerator_state

    restored = load_accelerator_state(
        str(folder), [], [], [], accelerator._dataloaders, accelerator.process_index, accelerator.scaler, "cpu"
    )
    if "step" in restored:
        accelerator.step = restored["step"]


def set_micro_step(accelerator, micro_batches: int) -> None:
    """Accelerate counts the epoch's micro-batches (``Accelerator.step``, settable but undocumented) to know when an
    accumulation window closes. A checkpoint continued on another layout restored the old layout's count (or none
    for a process index it did not have); the resume sets the new layout's."""
    accelerator.step = micro_batches


def mark_loader_finished(loader) -> None:
    """A stream's loader whose pass another process ended first: what a checkpoint taken from now on must record
    is a finished pass, so that torchdata's ``StatefulDataLoader`` starts the next one afresh. Accelerate keeps the
    loader's state in ``dl_state_dict`` and torchdata marks a finished pass with the private key
    ``_iterator_finished``; neither has an API to end a pass early."""
    loader.dl_state_dict["_iterator_finished"] = True


def building_fsdp_on_cpu():
    """A context in which Accelerate's ``AcceleratorState`` sets up FSDP on CPU processes. Accelerate 1.16 sets
    ``DistributedType.FSDP`` only in its multi-GPU branch (``AcceleratorState.__init__``) and otherwise leaves the
    plugin unused without a word; the already-joined CPU state is made to read as multi-GPU while the
    ``Accelerator`` is built (``PartialState._shared_state``, the singleton's shared dict), and put back if the
    constructor fails half-way. No public switch exists."""
    import contextlib

    from accelerate import PartialState

    @contextlib.contextmanager
    def context():
        shared = PartialState._shared_state
        shared["distributed_type"] = (
            DistributedType.MULTI_GPU
        )  # read by AcceleratorState.__init__, which writes FSDP back
        try:
            yield
        finally:
            if shared["distributed_type"] == DistributedType.MULTI_GPU:
                shared["distributed_type"] = DistributedType.MULTI_CPU

    return context()


def skip_deepspeed_shm_op() -> None:
    """DeepSpeed's ``TorchBackend`` on a CPU builds a shared-memory all-reduce op when its process group starts
    (a JIT compile: a minute on a fresh machine) and does so for one process too, which never all-reduces through
    it; acceltrain runs DeepSpeed on a CPU in one process only. Its module-level ``build_shm_op`` is replaced by one
    that returns None, which ``TorchBackend`` reads as "no such op", as where the op cannot be built. No setting
    turns the build off."""
    import importlib

    backend = importlib.import_module("deepspeed.comm.torch")  # the attribute deepspeed.comm.torch is torch itself
    backend.build_shm_op = lambda: None


def _loader_state_base():
    """Accelerate's ``DataLoaderStateMixin``, which ``acceltrain.vision.DeviceImageLoader`` subclasses: a loader that
    never goes through ``prepare`` (it is made on the device) must register with ``GradientState`` as a prepared
    ``DataLoaderShard`` does, so that ``accumulate`` syncs at each epoch's end; the mixin (``begin``, ``end``,
    ``end_of_dataloader``, and the private ``_drop_last`` it reads) is that protocol, undocumented."""
    from accelerate.data_loader import DataLoaderStateMixin

    return DataLoaderStateMixin


LoaderStateMixin = _loader_state_base()
