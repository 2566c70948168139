"""``--async-checkpoint``: checkpoints written while training goes on (Accelerate has no async save: accelerate#3746).

The step that saves blocks only for what must be taken at that instant: a copy of the model and optimizer state in
CPU memory (DCP's ``async_save`` stages FSDP's shards; under DDP the main process copies the whole state dicts;
both keep that copy between saves and copy into it, which costs that much memory and saves the allocation),
the small files Accelerate writes beside them (RNG states, loader positions, the grad scaler), the hooks' states and
the trainer state. A thread then writes the copy in Accelerate's own layout, so that ``load_state`` reads it as any
other checkpoint. The checkpoint counts only once every process's files are on disk: the main process then writes
its manifest and renames it into place (:func:`acceltrain.checkpointing.publish`), in a thread too. At most one save
is in flight: the next waits for it, and so does the end of the run, a stop to be resumed included. The processes
learn where a save stands at each optimizer step, over gloo groups of their own: DCP's collectives in its writer
threads never meet training's or each other's.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections import OrderedDict
from pathlib import Path

import torch
from accelerate.utils import DistributedType
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from .checkpointing import CheckpointError, RunState, failed_save, failed_save_refused, publish, staging_folder, write_run_files
from .distributed import any_process
from .options import ConfigError

POLL_SECONDS = 0.05  # between checks while waiting for a save in flight


def check_async_supported(accelerator) -> None:
    """DeepSpeed writes its own checkpoints; FSDP's full state dicts are gathered by a collective at the save."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        raise ConfigError("--async-checkpoint works under DDP and FSDP; DeepSpeed writes its checkpoints itself: drop the flag")
    if accelerator.distributed_type == DistributedType.FSDP and "SHARDED" not in str(accelerator.state.fsdp_plugin.state_dict_type):
        raise ConfigError("--async-checkpoint under FSDP needs fsdp_state_dict_type: SHARDED_STATE_DICT in the accelerate config "
                          "(accelerate_configs/fsdp_cpu.yaml, fsdp.yaml)")


class AsyncCheckpointer:
    """The run's saves under ``--async-checkpoint``: :meth:`save` blocks for the copy, :meth:`poll` (each optimizer
    step, every process) publishes what is written, :meth:`wait` blocks until nothing is in flight."""

    def __init__(self, accelerator):
        import torch.distributed as dist

        check_async_supported(accelerator)
        self.accelerator = accelerator
        several = accelerator.num_processes > 1
        # flags, the model's DCP save and the optimizer's: one gloo group each, so that no two threads share one
        self._groups = [dist.new_group(backend="gloo") if several else None for _ in range(3)]
        self._save: _InFlight | None = None
        self._copy: dict = {}  # DDP: the last save's CPU copy, reused (copied into) by the next one
        self._stagers: list = []  # FSDP: DCP's stagers for the model and the optimizer, with their cached CPU copies

    @property
    def in_flight(self) -> bool:
        return self._save is not None

    def save(self, model, optimizer, state: RunState, output_dir: Path, write_extra) -> None:
        """Stage checkpoint ``state.step`` and start writing it (every process); returns once training may go on. The
        caller has waited for the save before (:meth:`wait`), whose folder it announces."""
        from accelerate.checkpointing import save_accelerator_state

        if self._save is not None:
            raise RuntimeError("a checkpoint is still in flight: wait() for it (and announce it) before the next save")
        accelerator = self.accelerator
        final, staging = staging_folder(accelerator, output_dir, state.step)
        with failed_save_refused(final, staging):
            staging.mkdir(parents=True, exist_ok=True)
            accelerator.wait_for_everyone()
            save_accelerator_state(str(staging), [], [], [], accelerator._dataloaders, accelerator.process_index, accelerator.step,
                                   accelerator.scaler, save_on_each_node=accelerator.project_configuration.save_on_each_node)
            if accelerator.distributed_type == DistributedType.FSDP:
                writes = self._stage_shards(model, optimizer, staging)
            else:
                writes = self._stage_whole(model, optimizer, staging)
            if accelerator.is_main_process:
                write_run_files(staging, state, write_extra)
        self._save = _InFlight(final, staging, writes)

    def _stage_shards(self, model, optimizer, staging: Path):
        """FSDP: DCP's ``async_save`` of this process's shards, in the folders Accelerate's ``load_state`` reads."""
        import torch.distributed.checkpoint as dcp
        from accelerate.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        if not self._stagers:  # a kept copy (the next save copies into it) and cached plans: the step blocks for less
            self._stagers = [_CopyInto() for _ in range(2)]
        parts = [({"model": get_model_state_dict(model)}, f"{FSDP_MODEL_NAME}_0"),
                 ({"optimizer": get_optimizer_state_dict(model, optimizer.optimizer)}, f"{OPTIMIZER_NAME}_0")]
        futures = [dcp.async_save(state, checkpoint_id=str(staging / folder), process_group=group, async_stager=stager,
                                  planner=dcp.DefaultSavePlanner(enable_plan_caching=True))
                   for (state, folder), group, stager in zip(parts, self._groups[1:], self._stagers)]
        return lambda: [future.result() for future in futures]

    def _stage_whole(self, model, optimizer, staging: Path):
        """DDP or one process: the main process copies the whole state dicts and writes them as ``save_state`` does."""
        from accelerate.utils import save
        from accelerate.utils.constants import OPTIMIZER_NAME, SAFE_WEIGHTS_NAME

        if not self.accelerator.is_main_process:
            return lambda: None
        weights = _copied_to_cpu(OrderedDict(self.accelerator.get_state_dict(model, unwrap=False)), self._copy.get("weights"))
        optimizer_state = _copied_to_cpu(optimizer.state_dict(), self._copy.get("optimizer"))
        self._copy = {"weights": weights, "optimizer": optimizer_state}  # the writer reads it until published; then reused

        def write():
            save(weights, staging / SAFE_WEIGHTS_NAME, safe_serialization=True)
            save(optimizer_state, staging / f"{OPTIMIZER_NAME}.bin")

        return write

    def poll(self) -> Path | None:
        """Where the save in flight stands, agreed by every process: the checkpoint's folder once it is published
        (the caller then runs ``on_save``), else None. A write that failed anywhere is one CheckpointError everywhere."""
        save = self._save
        if save is None:
            return None
        written = save.writer.done()
        if written and self.accelerator.is_main_process and save.publisher is None and save.all_written:
            save.publisher = _Task(lambda: publish(save.staging, save.final))
        published = save.publisher is not None and save.publisher.done()
        failed = bool(save.writer.error or (save.publisher and save.publisher.error))
        if self.accelerator.num_processes > 1:
            unwritten, failed, published = any_process(not written, failed, published, group=self._groups[0])
            written = not unwritten
        save.all_written = written
        if failed:
            self._save = None
            error = save.writer.error or (save.publisher and save.publisher.error)
            if self.accelerator.is_main_process:
                shutil.rmtree(save.staging, ignore_errors=True)
            raise failed_save(save.final, error) if error else CheckpointError(
                f"could not write checkpoint {str(save.final)!r}: the save failed on another process; the previous checkpoints are intact")
        if published:
            self._save = None
            return save.final
        return None

    def wait(self) -> Path | None:
        """Block until the save in flight is published (every process): the folder, or None when none was in flight."""
        while self._save is not None:
            folder = self.poll()
            if folder is not None:
                return folder
            time.sleep(POLL_SECONDS)
        return None


class _CopyInto(BlockingAsyncStager):
    """DCP's blocking stager, its CPU copy kept and copied into by the next save (torch's own cache pins that memory,
    which needs a GPU)."""

    def __init__(self):
        super().__init__()
        self.copy = None

    def stage(self, state_dict):
        self.copy = _copied_to_cpu(state_dict, self.copy)
        return self.copy


class _Task:
    """A function run in a daemon thread (the process may end without it: a checkpoint it never published is
    left incomplete, and ``--resume auto`` continues from the previous one); its error kept for the main thread."""

    def __init__(self, work):
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(work,), daemon=True, name="acceltrain-checkpoint")
        self._thread.start()

    def _run(self, work) -> None:
        try:
            work()
        except BaseException as err:  # noqa: BLE001 - reported by poll() on the main thread
            self.error = err

    def done(self) -> bool:
        return not self._thread.is_alive()


class _InFlight:
    def __init__(self, final: Path, staging: Path, write):
        self.final, self.staging = final, staging
        self.writer = _Task(write)
        self.publisher: _Task | None = None
        self.all_written = False  # every process's files are on disk (as of the last poll)


def _copied_to_cpu(value, into=None):
    """A state dict (nested dicts and lists of tensors and numbers) with every tensor copied to the CPU (the step that
    follows changes the model's and optimizer's tensors in place), into ``into``'s tensors where they fit: the
    previous save's copy, so that a save after the first copies into memory already there."""
    if isinstance(value, torch.Tensor):
        if isinstance(into, torch.Tensor) and (into.shape, into.dtype) == (value.shape, value.dtype):
            return into.copy_(value.detach())
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        into = into if isinstance(into, dict) else {}
        return type(value)((k, _copied_to_cpu(v, into.get(k))) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        into = into if isinstance(into, (list, tuple)) and len(into) == len(value) else [None] * len(value)
        return type(value)(_copied_to_cpu(v, i) for v, i in zip(value, into))
    return value
