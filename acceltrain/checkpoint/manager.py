"""The one owner of a run's checkpoints, after torchtitan's ``CheckpointManager``: the loop calls :meth:`restore`
once, :meth:`save` when the processes agree to save, :meth:`poll` at each optimizer step, :meth:`wait` before it
stops and :meth:`close` at the end. It knows what a checkpoint holds (the model and optimizer parts the run's engine
gives, :mod:`acceltrain.engines`; Accelerate's RNG and loader files, the LR scheduler, the loop's :class:`RunState`
and the hooks' states), which engine wrote it, whether an adapter run's frozen base is left out, and whether the
bytes are written now or while training goes on; the loop knows none of it."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
from accelerate.logging import get_logger

from acceltrain.accelerate_compat import load_loop_state, save_loop_state, set_micro_step
from acceltrain.checkpoint import adapters, hook_states
from acceltrain.checkpoint.files import (
    checkpoint_engine,
    failed_save_refused,
    find_resume_checkpoint,
    staging_folder,
    verify_checkpoint,
)
from acceltrain.checkpoint.safe_load import (
    DCP_METADATA,
    check_loadable_without_code,
    load_dcp_metadata,
    loading_without_code,
)
from acceltrain.checkpoint.state import STATE_FILE, CheckpointError, RunState, check_scheduler_state
from acceltrain.checkpoint.writers import AsyncWriter, SyncWriter
from acceltrain.config.options import ConfigError, first_line
from acceltrain.config.train_config import run_changes
from acceltrain.runtime.preemption import TrainingDiverged
from acceltrain.runtime.run_folder import CHECKPOINTS_DIR, finished_steps

logger = get_logger(__name__)


class TrainerState(Protocol):
    """What the loop gives the checkpointer of its own state."""

    total_steps: int
    step: int

    def layout(self) -> RunState: ...  # the layout fields of this run (what a resume must keep or map)

    def snapshot(self) -> RunState: ...  # the state a checkpoint taken now records (may be a collective)

    def restore(self, state: RunState) -> None: ...

    def step_boundary(self) -> RunState: ...  # the state at the last optimizer step, for a live peer

    def heal(self, state: RunState) -> None: ...  # continue from a live peer's step_boundary()


class Checkpointer:
    """``prepared``: the run's prepared pieces (its engine, model, optimizer, scheduler, config); ``trainer``: the
    loop's state; ``hooks``: the stateful hooks by name; ``announce``: called with each published checkpoint."""

    def __init__(self, prepared, trainer: TrainerState, hooks: dict, *, announce: Callable[[Path], None]):
        self.engine, self.accelerator, self.cfg = prepared.engine, prepared.accelerator, prepared.cfg
        if self.cfg.async_checkpoint:
            self.engine.check_async_supported()
        self.model, self.optimizer, self.scheduler = prepared.model, prepared.optimizer, prepared.scheduler
        self.trainer, self.hooks, self._announce = trainer, hooks, announce
        self.output_dir = Path(self.cfg.output_dir)
        self.frozen = adapters.frozen_names(self.accelerator, self.model)
        self.writer = AsyncWriter(self.accelerator) if self.cfg.async_checkpoint else SyncWriter(self.accelerator)
        self.last_saved_step: int | None = None
        self.resumed_from_step: int | None = None
        self.seconds_blocked = 0.0  # this launch's time blocked by saves (the waits below included)
        self.seconds_waited = 0.0  # of which optimizer steps waited for an async save's copy
        self._step_hook = (  # the copy of the weights and optimizer state overlaps the next forward and backward
            getattr(self.optimizer, "optimizer", self.optimizer).register_step_pre_hook(lambda *_: self._before_step())
            if self.cfg.async_checkpoint
            else None
        )
        self.engine.share_state(self.live_state, self.heal)

    def check_states(self) -> None:
        """Right after ``on_fit_start``: a hook state that could not be saved (or not read back as it was) is one
        line now, not at the first checkpoint."""
        hook_states.check_states(self.hooks)

    @property
    def note(self) -> str | None:
        """What the start-up log says of the checkpoints' contents, if anything."""
        return adapters.describe(self.frozen)

    # ---- a live peer's state (an engine that heals a process without a restart: torchft)

    def live_state(self) -> dict:
        """What a checkpoint holds, in memory, at the last optimizer step: the model's weights copied (a forward
        changes its buffers while a peer reads them), the optimizer's and the hooks' states as they are."""
        model = self.accelerator.unwrap_model(self.model)
        return {
            "model": {name: tensor.detach().clone() for name, tensor in model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "trainer": dataclasses.asdict(self.trainer.step_boundary()),
            "hooks": {name: hook.state_dict() for name, hook in self.hooks.items()},
        }

    def heal(self, state: dict) -> int:
        """Continue from a live peer's :meth:`live_state`; returns the step it stands at."""
        self.accelerator.unwrap_model(self.model).load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        for name, hook in self.hooks.items():
            hook.load_state_dict(state["hooks"][name])
        self.trainer.heal(RunState(**state["trainer"]))
        logger.info(f"healed from a live peer at step {self.trainer.step}")
        return self.trainer.step

    # ---- saving

    def save(self) -> float:
        """Checkpoint now (every process): published at once, or with ``--async-checkpoint`` once written (announced
        by a later :meth:`poll`); at most one save in flight. Returns the seconds this call blocked training."""
        if not self.engine.writes_checkpoints():
            self.last_saved_step = self.trainer.step
            return 0.0
        started = time.perf_counter()
        self._published(self.writer.wait())
        self._refuse_non_finite_weights()
        state = dataclasses.replace(
            self.trainer.snapshot(),
            scheduler=self.scheduler.state_dict(),
            hooks=list(self.hooks),
            engine=self.engine.checkpoint_format,
        )
        final, staging = staging_folder(self.accelerator, self.output_dir, state.step)
        with failed_save_refused(final, staging):
            staging.mkdir(parents=True, exist_ok=True)
            self.accelerator.wait_for_everyone()
            parts = self.engine.checkpoint_parts(self.model, self.optimizer, self.frozen)
            save_loop_state(self.accelerator, staging)
            if self.accelerator.is_main_process:
                hook_states.save_states(staging, self.hooks)
                (staging / STATE_FILE).write_text(_as_json(state))
            self.writer.start(parts, staging, final)
        self.last_saved_step = state.step
        self._published(self.writer.poll())
        blocked = time.perf_counter() - started
        self.seconds_blocked += blocked
        return blocked

    def _before_step(self) -> None:
        waited = self.writer.before_step()
        self.seconds_waited += waited
        self.seconds_blocked += waited

    def poll(self) -> None:
        """Announce a save in flight that has been published (every process, at each optimizer step)."""
        if self.writer.in_flight:
            self._published(self.writer.poll())

    def wait(self) -> None:
        """Block until a save in flight is published, and announce it."""
        self._published(self.writer.wait())

    def close(self) -> None:
        self.wait()

    def release(self) -> None:
        """Let go of the user's optimizer, however the run ended: its step pre-hook would keep this checkpointer, and
        with it the async writer's process groups, alive after ``fit()`` returns; and of the state shared with the
        engine."""
        self.engine.release()
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None

    def _published(self, folder: Path | None) -> None:
        if folder is not None:
            self._announce(folder)
            logger.info(f"checkpoint: {folder}")

    def _refuse_non_finite_weights(self) -> None:
        """A finite loss can still leave inf weights behind: never checkpoint them (agreed by every process: a
        sharded model's non-finite values may sit on one process only)."""
        local = [
            p.to_local() if hasattr(p, "to_local") else p for p in self.model.parameters()
        ]  # FSDP: this process's shard
        finite = torch.stack([torch.isfinite(p).all() for p in local]).all()
        if self.accelerator.num_processes > 1:
            finite = self.accelerator.reduce(finite.float(), "min") > 0
        if not finite:
            kept = f"; the last checkpoint is step {self.last_saved_step}" if self.last_saved_step is not None else ""
            raise TrainingDiverged(
                f"training diverged at step {self.trainer.step}: the weights are not finite; nothing was "
                f"saved from this step on{kept}; lower --lr or clip with --max-grad-norm"
            )

    # ---- restoring

    def restore(self) -> bool:
        """``--resume``: find and verify the checkpoint on the main process, agree on it everywhere, check that it
        continues this run, and load it: the model and optimizer (the engine's reader of its parts), the grad scaler,
        RNG and loaders (Accelerate's reader of its files), the scheduler, the loop's state and the hooks' states. False
        when the run in the folder finished at that checkpoint: nothing to do."""
        path, saved = self._agreed_checkpoint(
            lambda: find_resume_checkpoint(self.cfg.resume, self.output_dir, warn=logger.warning)
        )
        finished = finished_steps(self.output_dir)
        if path is None:
            if finished is not None:
                raise ConfigError(
                    f"--output-dir {str(self.output_dir)!r} holds a finished run but no checkpoint to resume: "
                    "use --overwrite to replace it"
                )
            logger.info(f"--resume auto: no complete checkpoint in {self.output_dir / CHECKPOINTS_DIR}; starting fresh")
            return True
        self._check_engine(path, saved)
        current = self.trainer.layout()
        saved.check_compatible(current, path)
        relayout = saved.relayout(current)
        if relayout:
            self._check_relayout_supported(saved, current, path)
        changes = run_changes(saved.config, self.cfg, layout_free=relayout)
        if finished is not None:
            if saved.step >= finished and not changes:
                return False
            raise ConfigError(
                f"--output-dir {str(self.output_dir)!r} holds a finished run ({finished} steps): resuming the "
                f"checkpoint of step {saved.step} there would overwrite it; give another --output-dir to continue from "
                "that checkpoint into it"
            )
        described = ", ".join(f"{name} {old} -> {new}" for name, (old, new) in changes.items())
        if changes and not self.cfg.allow_config_change:
            raise ConfigError(
                f"checkpoint {str(path)!r} was written with other settings: {described}; resume with the same "
                "settings, or pass --allow-config-change to apply the new ones"
            )
        if saved.step > self.trainer.total_steps:
            raise CheckpointError(
                f"checkpoint {str(path)!r} is at step {saved.step}, past the {self.trainer.total_steps} optimizer "
                "steps of this run: resume with the --max-steps or --epochs it was written with, or start a "
                "new --output-dir"
            )
        check_scheduler_state(saved.scheduler, self.scheduler.state_dict(), saved.step, path)
        check_loadable_without_code(path, digests_required=True)
        self._check_shards_fit(path)
        hook_states.load_states(path, self.hooks, saved.hooks)
        fresh = self.scheduler.hyperparameters()  # this launch's, which the load replaces with the checkpoint's
        self._load(path)
        if relayout:
            saved = self._continue_in_layout(saved, current)
        if saved.scheduler:
            self.scheduler.load_state_dict(saved.scheduler)
        if changes:
            saved.config_changes.update(changes)
            self.scheduler.apply(fresh)
            logger.info(f"--allow-config-change: applying {described}")
        self.trainer.restore(saved)
        self.last_saved_step = self.resumed_from_step = saved.step
        logger.info(
            f"resumed from {path} at step {saved.step} (epoch {saved.epoch}, {saved.batch_in_epoch} batches into it)"
        )
        if not current.batches_per_epoch and current.data_fingerprint is None:  # a stream: no length to compare either
            logger.info(
                "the training stream has no fingerprint attribute: whether it still holds the data the checkpoint was "
                "trained on cannot be checked"
            )
        return True

    def load_model_of(self, path: Path) -> None:
        """At the end of a run: the model of checkpoint ``path`` (one this run wrote: ``--load-best-at-end``) loaded
        into the model, to be exported as the run's weights. Verified as a resume verifies its checkpoint (every
        file against the manifest, every pickle without code): the files may have changed since they were written.
        Refused in one line that keeps every checkpoint: another checkpoint's weights exported instead would be
        silently wrong."""
        try:
            _, saved = self._agreed_checkpoint(lambda: (path, verify_checkpoint(_present(path))))
            check_loadable_without_code(path, digests_required=True)
            self._load(path)
        except ConfigError as err:
            raise CheckpointError(
                f"--load-best-at-end: the best checkpoint cannot be used: {err}; nothing was exported and no "
                "checkpoint was deleted: run again with --resume auto and without --load-best-at-end to export the "
                "last step's weights"
            ) from None
        logger.info(f"the run folder's weights are those of {path}")

    def _agreed_checkpoint(self, find: Callable[[], tuple | None]) -> tuple[Path | None, RunState | None]:
        """The checkpoint ``find`` finds and verifies (:func:`.files.verify_checkpoint`) on the main process, with
        its state, the same on every process; or its one-line error on every one."""
        from accelerate.utils import broadcast_object_list

        found = [None, None, None]  # path, state fields, error
        # one process finds it itself: a torchft replica group other than replica 0 is not the main process
        if self.accelerator.is_main_process or self.accelerator.num_processes == 1:
            try:
                hit = find()
                if hit is not None:
                    found[:2] = [str(hit[0]), dataclasses.asdict(hit[1])]
            except ConfigError as err:
                found[2] = str(err)
        broadcast_object_list(found, from_process=0)
        path, fields, error = found
        if error:
            raise ConfigError(error)
        if path is None:
            return None, None
        return Path(path), RunState(**fields)

    def _load(self, path: Path) -> None:
        """Read back what :meth:`save` wrote, the same two halves: the engine's parts of the model and optimizer, and
        Accelerate's RNG, loader and grad-scaler files; every ``torch.load`` without running code. A model or
        optimizer that does not fit is one line."""
        from safetensors import SafetensorError
        from torch.distributed.checkpoint.api import CheckpointException

        strict = adapters.strict_load(self.accelerator, self.model, self.frozen, path)
        try:
            with loading_without_code():
                self.engine.load_parts(path, self.model, self.optimizer, strict=strict)
                load_loop_state(self.accelerator, path)
        except (RuntimeError, KeyError, ValueError, IndexError, SafetensorError, CheckpointException) as err:
            raise CheckpointError(
                f"checkpoint {str(path)!r} does not fit this model or optimizer: {first_line(err)}"
            ) from None

    def _check_engine(self, path: Path, saved: RunState) -> None:
        """A checkpoint loads under the engine that wrote it (Accelerate would look for files that are not there)."""
        wrote = checkpoint_engine(path, saved)
        if wrote != self.engine.checkpoint_format:
            weights = " (its weights alone: DeepSpeed's zero_to_fp32.py in that folder)" if wrote == "DeepSpeed" else ""
            shown = "DDP or single-process" if wrote == "DDP" else wrote
            raise CheckpointError(
                f"checkpoint {str(path)!r} holds {shown} model and optimizer state and this run is "
                f"{self.engine.name}: resume it under {shown}, as it was written{weights}, or start a new --output-dir"
            )

    def _check_shards_fit(self, path: Path) -> None:
        """The engine's DCP shards hold this model's tensors, by name and whole shape (DCP would fail on every process
        with a CheckpointException naming one tensor, deep inside its load plan)."""
        folder = self.engine.sharded_model()
        metadata = path / folder / DCP_METADATA if folder else None
        if metadata is None or not metadata.is_file():  # no shards (whole state dicts, or the engine's own files)
            return
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        saved = {
            name.removeprefix("model."): tuple(meta.size)
            for name, meta in load_dcp_metadata(metadata).state_dict_metadata.items()
            if hasattr(meta, "size")
        }
        mine = {name: tuple(tensor.shape) for name, tensor in get_model_state_dict(self.model).items()}
        differ = sorted(name for name in saved.keys() | mine.keys() if saved.get(name) != mine.get(name))
        if differ:
            name = differ[0]
            raise CheckpointError(
                f"checkpoint {str(path)!r} holds another model than this run's: {len(differ)} tensors differ (e.g. "
                f"{name}: {_shape(saved.get(name))} in the checkpoint, {_shape(mine.get(name))} here); resume with the "
                "model it was written with, or start a new --output-dir"
            )

    def _check_relayout_supported(self, saved: RunState, current: RunState, path: Path) -> None:
        """Whether the engine's checkpoints continue on another process count (DeepSpeed's partitions do not; DCP
        reshards FSDP's on load)."""
        refusal = self.engine.relayout_refusal(saved.num_processes, current.num_processes)
        if refusal:
            raise CheckpointError(f"checkpoint {str(path)!r} {refusal}")

    def _continue_in_layout(self, saved: RunState, current: RunState) -> RunState:
        """A checkpoint of another layout: the same samples of the epoch done, counted in this layout's batches.
        The data order and augmentation are keyed on (seed, epoch, index), so they continue unchanged; the
        per-process RNG streams (dropout) cannot map onto another count and are re-derived from (seed, step,
        process index)."""
        from accelerate.utils import set_seed

        from acceltrain.data.loaders import mix_seed

        if saved.num_processes != current.num_processes:
            set_seed(mix_seed(self.cfg.seed, saved.step, self.accelerator.process_index) % 2**32)
        logger.info(
            f"resuming a checkpoint of {saved.layout()} on {current.layout()}; per-process random streams "
            f"{'re-derived' if saved.num_processes != current.num_processes else 'kept'}"
        )
        moved = saved.in_layout(current)
        set_micro_step(self.accelerator, moved.batch_in_epoch)
        return moved


def _present(path: Path) -> Path:
    """``path``, a checkpoint folder this run wrote, if it is still there (Accelerate would say it does not fit)."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} is missing")
    return path


def _shape(shape: tuple | None) -> str:
    return "absent" if shape is None else f"[{', '.join(map(str, shape))}]"


def _as_json(state: RunState) -> str:
    import json

    return json.dumps(dataclasses.asdict(state), indent=2)
