"""The two writers of a checkpoint's model and optimizer parts (each engine's ``checkpoint_parts``), one
protocol: ``start`` the parts of a save, ``poll`` for the folder once it is published (every process's files on
disk, then the main process's manifest and atomic rename), ``wait`` until nothing is in flight. They differ only in
when the bytes hit the disk:

- :class:`SyncWriter` writes and publishes inside ``start``;
- :class:`AsyncWriter` (``--async-checkpoint``; Accelerate has no async save, accelerate#3746) blocks only for a
  copy in CPU memory (DCP's ``async_save`` stages FSDP's shards; under DDP the main process copies the whole
  state dicts; both copy into the previous save's copy), then a thread writes and another publishes. Under DDP the
  copy overlaps the next step's forward and backward: what they change (buffers) is copied at the save, the weights
  and optimizer state by the writer thread, and the next optimizer step waits for that copy
  (:meth:`AsyncWriter.before_step`; the wait counts as time the save blocked training). The processes learn where a
  save stands at each optimizer step (:meth:`AsyncWriter.poll`), over gloo groups of their own: DCP's collectives in
  its writer threads never meet training's or each other's. At most one save is in flight.

A write that fails on any process is one CheckpointError on every process, the previous checkpoints intact.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from acceltrain.checkpoint.files import failed_save, publish
from acceltrain.checkpoint.state import CheckpointError
from acceltrain.engines.base import ENGINE, PICKLE, SAFETENSORS, SHARDS, Part
from acceltrain.runtime.distributed import any_process

POLL_SECONDS = 0.05  # between checks while waiting for a save in flight


def write_part(part: Part, folder: Path, process_group=None) -> None:
    """Write ``part`` into ``folder`` now (the form decides who writes: the main process its whole state dicts, every
    process its shards or the engine's files)."""
    if part.form == SAFETENSORS:
        from safetensors.torch import save_file

        save_file(part.state, str(folder / part.name), metadata={"format": "pt"})
    elif part.form == PICKLE:
        torch.save(part.state, folder / part.name)
    elif part.form == SHARDS:
        import torch.distributed.checkpoint as dcp

        dcp.save(
            part.state,
            checkpoint_id=str(folder / part.name),
            process_group=process_group,
            planner=part.planner(enable_plan_caching=True),
        )
    elif part.form == ENGINE:
        part.state(folder)
    else:
        raise ValueError(part.form)


class SyncWriter:
    """Writes and publishes a save inside :meth:`start`."""

    in_flight = False

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self._published: Path | None = None

    def start(self, parts: list[Part], staging: Path, final: Path) -> None:
        _agreed(self.accelerator, final, lambda: [write_part(part, staging) for part in parts])
        _agreed(self.accelerator, final, lambda: publish(staging, final) if self.accelerator.is_main_process else None)
        self._published = final

    def poll(self) -> Path | None:
        published, self._published = self._published, None
        return published

    wait = poll

    def before_step(self) -> float:
        return 0.0


def _agreed(accelerator, final: Path, work) -> None:
    """``work()`` on every process, then one agreement: a failure anywhere fails everywhere (no process is left
    waiting at the next collective for one that raised)."""
    error = None
    try:
        work()
    except (OSError, RuntimeError, ValueError) as err:  # torch reports a full disk from C++ as a RuntimeError
        error = err
    if accelerator.num_processes > 1:
        [failed] = any_process(error is not None)
    else:
        failed = error is not None
    if failed:
        raise failed_save(final, error) if error else _failed_elsewhere(final)


def _failed_elsewhere(final: Path) -> CheckpointError:
    return CheckpointError(
        f"could not write checkpoint {str(final)!r}: the save failed on another process; "
        "the previous checkpoints are intact"
    )


class AsyncWriter:
    """:meth:`start` blocks for the copy; :meth:`poll` (each optimizer step, every process) returns the folder once
    published; :meth:`wait` blocks until nothing is in flight."""

    def __init__(self, accelerator):
        import torch.distributed as dist

        self.accelerator = accelerator
        several = accelerator.num_processes > 1
        # flags, the model's DCP save and the optimizer's: one gloo group each, so that no two threads share one
        self._groups = [dist.new_group(backend="gloo") if several else None for _ in range(3)]
        self._save: _InFlight | None = None
        self._copies: dict[str, dict] = {}  # the last save's CPU copies of whole state dicts, copied into by the next
        self._stagers: dict[str, _CopyInto] = {}  # DCP's stagers of the shards, with their copies
        self._copied = threading.Event()  # the writer thread's copy is done: the optimizer may step
        self._copied.set()

    @property
    def in_flight(self) -> bool:
        return self._save is not None

    def start(self, parts: list[Part], staging: Path, final: Path) -> None:
        if self._save is not None:
            raise RuntimeError("a checkpoint is still in flight: wait() for it (and announce it) before the next save")
        whole = [part for part in parts if part.form in (SAFETENSORS, PICKLE)]
        shards = [part for part in parts if part.form == SHARDS]
        groups = self._groups[1:]  # one per sharded part (the model's, the optimizer's); no shards: none used
        futures = [self._stage_shards(part, staging, group) for part, group in zip(shards, groups, strict=False)]
        for part in whole:  # now: what the next forward and backward change
            self._copy(part, part.changes_before_step)

        def write() -> None:
            try:  # the rest, while training goes on until the next optimizer step
                copies = [
                    Part(part.name, self._copy(part, set(part.state) - part.changes_before_step), part.form)
                    for part in whole
                ]
            finally:
                self._copied.set()
            for part in copies:
                write_part(part, staging)
            for future in futures:
                future.result()

        self._copied.clear()
        self._save = _InFlight(final, staging, write)

    def before_step(self) -> float:
        """Wait until the save in flight has copied what the optimizer step changes; the seconds waited."""
        if self._copied.is_set():
            return 0.0
        started = time.perf_counter()
        self._copied.wait()
        return time.perf_counter() - started

    def _copy(self, part: Part, keys) -> dict:
        """``part``'s state with the tensors of ``keys`` copied to the CPU, into the previous save's copy; the
        whole state in its own order (the other keys as copied before, or about to be)."""
        copy = self._copies.setdefault(part.name, {})
        for key in keys:
            copy[key] = copied_to_cpu(part.state[key], copy.get(key))
        return type(part.state)((key, copy.get(key)) for key in part.state)

    def _stage_shards(self, part: Part, staging: Path, group):
        """DCP's ``async_save`` of this process's shards (its stager copies into the previous save's copy)."""
        import torch.distributed.checkpoint as dcp

        stager = self._stagers.setdefault(part.name, _CopyInto())
        return dcp.async_save(
            part.state,
            checkpoint_id=str(staging / part.name),
            process_group=group,
            async_stager=stager,
            planner=part.planner(enable_plan_caching=True),
        )

    def poll(self) -> Path | None:
        """Where the save in flight stands, agreed by every process: the checkpoint's folder once it is published,
        else None. A write that failed anywhere is one CheckpointError everywhere."""
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
            refusal = failed_save(save.final, error) if error else _failed_elsewhere(save.final)  # a full disk shows
            if self.accelerator.is_main_process:
                shutil.rmtree(save.staging, ignore_errors=True)
            raise refusal
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
        self.copy = copied_to_cpu(state_dict, self.copy)
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


def copied_to_cpu(value, into=None):
    """A state dict (nested dicts and lists of tensors and numbers) with every tensor copied to the CPU (the step that
    follows changes the model's and optimizer's tensors in place), into ``into``'s tensors where they fit: the
    previous save's copy, so that a save after the first copies into memory already there."""
    if isinstance(value, torch.Tensor):
        if isinstance(into, torch.Tensor) and (into.shape, into.dtype) == (value.shape, value.dtype):
            return into.copy_(value.detach())
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        into = into if isinstance(into, dict) else {}
        return type(value)((k, copied_to_cpu(v, into.get(k))) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        into = into if isinstance(into, (list, tuple)) and len(into) == len(value) else [None] * len(value)
        return type(value)(copied_to_cpu(v, i) for v, i in zip(value, into, strict=True))
    return value
