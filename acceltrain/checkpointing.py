"""The run folder and what is written into it: checkpoints that are complete or absent (never half
written), exact resume, rotation, preemption signals, final weights and ``summary.json``."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import math
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

from .config import TrainConfig
from .options import ConfigError, first_line, parse_json, shorten

SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"
WEIGHTS_FILE = "model.safetensors"


def resolve_output_dir(cfg: TrainConfig, recipe_name: str) -> Path:
    """``--output-dir``, or ``runs/<recipe>-<timestamp>`` agreed by all processes. Refuses a folder that
    already holds a finished run unless ``--overwrite``: a typo must not replace last week's results."""
    from accelerate.utils import broadcast_object_list

    if cfg.output_dir is not None:
        output_dir = Path(cfg.output_dir)
    elif cfg.resume is not None:  # --resume PATH: the run folder that holds checkpoints/PATH
        output_dir = Path(cfg.resume).resolve().parent.parent
    else:
        stamp = [time.strftime("%Y%m%d-%H%M%S")]
        broadcast_object_list(stamp, from_process=0)
        output_dir = Path("runs") / f"{recipe_name}-{stamp[0]}"
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"--output-dir {str(output_dir)!r} exists and is not a directory")
    if (output_dir / SUMMARY_FILE).exists() and not (cfg.overwrite or cfg.resume):
        raise ConfigError(
            f"--output-dir {str(output_dir)!r} already holds a finished run ({SUMMARY_FILE}); "
            "pass --resume auto to continue it, --overwrite to replace it, or choose another --output-dir"
        )
    return output_dir


LOCK_FILE = ".lock"
_HELD_LOCKS: dict[str, int] = {}


def lock_output_dir(output_dir: Path) -> None:
    """Create ``output_dir`` if needed (a one-line ConfigError when it cannot be), and hold an exclusive
    ``flock`` on ``<output_dir>/.lock`` until :func:`unlock_output_dir` or this process
    ends (the kernel drops it when the process dies, so a crash leaves nothing locked). A folder that
    another live run holds is a one-line ConfigError. Again from the same process: a no-op."""
    import fcntl
    import socket

    key = str(output_dir.resolve())
    if key in _HELD_LOCKS:
        return
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(output_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:  # below a file, read-only, full
        raise ConfigError(f"--output-dir {str(output_dir)!r} cannot be written: {err.strerror or err}") from None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(descriptor, 200).decode(errors="replace").strip() or "pid unknown"
        os.close(descriptor)
        raise ConfigError(
            f"--output-dir {str(output_dir)!r} is in use by another run ({holder}): wait for it or stop it, "
            "or choose another --output-dir"
        ) from None
    os.ftruncate(descriptor, 0)
    os.write(descriptor, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
    _HELD_LOCKS[key] = descriptor


def unlock_output_dir(output_dir: Path | None = None) -> None:
    """Release this process's lock on ``output_dir`` (all of them when None)."""
    keys = list(_HELD_LOCKS) if output_dir is None else [str(Path(output_dir).resolve())]
    for key in keys:
        descriptor = _HELD_LOCKS.pop(key, None)
        if descriptor is not None:
            os.close(descriptor)


def move_previous_run_aside(output_dir: Path) -> Path | None:
    """``--overwrite``: a folder holding a run (summary, metrics, checkpoints or weights) is renamed to
    ``<name>.overwritten-<time>`` beside it, so that the new run starts clean and nothing of the old one
    is resumed by mistake, nor lost. Refused while a live run holds the folder. Returns the new name."""
    if not output_dir.is_dir() or not any((output_dir / name).exists() for name in (SUMMARY_FILE, METRICS_FILE, CHECKPOINTS_DIR, WEIGHTS_FILE)):
        return None
    lock_output_dir(output_dir)
    unlock_output_dir(output_dir)
    aside = output_dir.with_name(f"{output_dir.name}.overwritten-{time.strftime('%Y%m%d-%H%M%S')}")
    os.rename(output_dir, aside)
    return aside


def finished_steps(output_dir: Path) -> int | None:
    """The step count of the finished run in ``output_dir`` (its summary.json), or None."""
    try:
        return int(parse_json((output_dir / SUMMARY_FILE).read_text())["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_summary(output_dir: Path, summary: dict) -> None:
    (output_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, default=str) + "\n")


# --------------------------------------------------------------------------- checkpoints

CHECKPOINTS_DIR = "checkpoints"
STATE_FILE = "trainer_state.json"
COMPLETE_FILE = "COMPLETE"  # the manifest, written last: a checkpoint without it is incomplete
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on a signal after saving; relaunch with --resume auto
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report death by SIGINT: saved on the first, at once on the second
EXIT_DIVERGED = 3  # a non-finite loss or gradient norm: nothing saved from that step on


class StoppedToResume(SystemExit):
    """The exit of a run that checkpointed to be resumed (75, or 130 after a first Ctrl-C); ``message`` says
    where and why, for the launcher's report (torchelastic's error file)."""

    def __init__(self, code: int, step: int, reason: str):
        super().__init__(code)
        self.message = f"stopped at step {step} to be resumed ({reason}); continue with --resume auto"


class TrainingDiverged(Exception):
    """A non-finite loss or gradient norm: the run stops without saving anything from that step on."""


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed from (incomplete, truncated, corrupted)."""


@dataclasses.dataclass
class RunState:
    """Where a run stands: with Accelerate's state (model, optimizer, grad scaler, RNG) and the hooks'
    ``state_dict()``, all that survives a resume. The :class:`~acceltrain.run.Run` keeps one current as it
    trains, and a checkpoint's ``trainer_state.json`` is it, taken at a step boundary: one set of names in
    memory and on disk. The data order and the augmentation need nothing more: both derive from (seed,
    epoch, index)."""

    # kept current as the run trains
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0  # per-process batches of ``epoch`` already trained on
    samples_seen: int = 0
    best_metric: float | None = None
    last_eval: dict = dataclasses.field(default_factory=dict)
    config_changes: dict = dataclasses.field(default_factory=dict)  # applied with --allow-config-change: field -> [old, new]
    # filled in when a checkpoint is taken (restored on resume)
    train_seconds: float = 0.0  # the run's training wall clock, earlier launches included
    loss_sum: float = 0.0  # the open training-log window, summed over processes: the next row covers the same steps
    loss_count: float = 0.0
    scheduler: dict = dataclasses.field(default_factory=dict)  # the LR scheduler's state_dict
    hooks: list = dataclasses.field(default_factory=list)  # names of the stateful hooks saved in hooks/
    config: dict = dataclasses.field(default_factory=dict)  # the resolved config, to compare on resume
    # the layout it was trained on: what a resume must keep, or map (another process count)
    seed: int = 0
    global_batch_size: int = 0  # samples of one micro-step over all processes: batch size x processes
    grad_accum: int = 1
    train_samples: int = 0
    data_fingerprint: str | None = None  # the training set's fingerprint, when it has one (acceltrain 0.3)
    num_processes: int = 0  # 0: not recorded (written before acceltrain 0.2)
    batches_per_epoch: int = 0  # per process; 0: not recorded

    @property
    def samples_per_step(self) -> int:
        return self.global_batch_size * self.grad_accum

    def layout(self) -> str:
        batch = self.global_batch_size // self.num_processes if self.num_processes else self.global_batch_size
        processes = f"{self.num_processes} processes x batch {batch}" if self.num_processes else f"global batch {batch}"
        return f"{processes} x grad_accum {self.grad_accum} = {self.samples_per_step} samples per optimizer step"

    def check_compatible(self, current: "RunState", path: Path) -> None:
        """Refuse what would not continue the same run. Another layout (process count, batch size,
        accumulation) continues it when every optimizer step covers the same samples: equal samples per
        step and per epoch (so the same steps per epoch, the same short last window)."""
        if None not in (self.data_fingerprint, current.data_fingerprint) and self.data_fingerprint != current.data_fingerprint:
            raise CheckpointError(
                f"checkpoint {str(path)!r} was trained on data whose fingerprint is {shorten(self.data_fingerprint, 24)}, this "
                f"run's training data has {shorten(current.data_fingerprint, 24)}: its content changed since; resuming would not "
                "continue the same run: restore the data, or start a new --output-dir"
            )
        for name in ("seed", "train_samples"):
            saved, now = getattr(self, name), getattr(current, name)
            if saved != now:
                raise CheckpointError(
                    f"checkpoint {str(path)!r} was written with {name}={saved}, this run has {name}={now}: "
                    "resuming would not continue the same run; use the same settings or start a new --output-dir"
                )
        if not self.relayout(current):
            return
        if self.num_processes and not self.batches_per_epoch:
            raise CheckpointError(
                f"checkpoint {str(path)!r} was written with {self.layout()}, this run has {current.layout()}, and it "
                "trained on a stream, whose loader position is recorded per layout: resume with its layout"
            )
        if not (self.num_processes and self.batches_per_epoch):
            raise CheckpointError(
                f"checkpoint {str(path)!r} was written with {self.layout()}, this run has {current.layout()}, and "
                "it predates acceltrain 0.2, which records what another layout needs: resume with its layout"
            )
        if self.samples_per_step != current.samples_per_step:
            per_process = current.global_batch_size  # batch size x processes of this run
            fit = f" (here: --grad-accum {self.samples_per_step // per_process})" if self.samples_per_step % per_process == 0 else ""
            raise CheckpointError(
                f"checkpoint {str(path)!r} was written with {self.layout()}, this run has {current.layout()}: resume "
                f"with {self.samples_per_step} samples per optimizer step{fit}"
            )
        saved_epoch = self.batches_per_epoch * self.global_batch_size
        now_epoch = current.batches_per_epoch * current.global_batch_size
        if saved_epoch != now_epoch:
            raise CheckpointError(
                f"checkpoint {str(path)!r} trained on {saved_epoch} samples per epoch ({self.layout()}), this layout "
                f"fills {now_epoch} ({current.layout()}): its last batches of an epoch would differ; resume with "
                "a batch size that divides the epoch as the checkpoint's did"
            )

    def relayout(self, current: "RunState") -> bool:
        """Whether ``current`` trains on another layout than this checkpoint's."""
        return (self.global_batch_size, self.grad_accum) != (current.global_batch_size, current.grad_accum) or (
            self.num_processes and self.num_processes != current.num_processes)

    def in_layout(self, current: "RunState") -> "RunState":
        """This state as the layout of ``current`` counts it: the same samples of the epoch trained on (a
        checkpoint sits at a step boundary, a whole number of this run's micro-steps), the new layout's fields."""
        position = self.batch_in_epoch * self.global_batch_size // current.global_batch_size
        layout = {name: getattr(current, name) for name in ("global_batch_size", "grad_accum", "num_processes", "batches_per_epoch")}
        return dataclasses.replace(self, batch_in_epoch=position, **layout)

    def contradiction(self) -> str | None:
        """What in these fields contradicts the rest (a hand-edited trainer_state.json), or None. A checkpoint
        sits at an optimizer-step boundary, so its place in the data and its sample count follow from its step."""
        if not self.num_processes:  # written before acceltrain 0.2: no batches_per_epoch to check against
            return None
        micro_batches = self.step * self.grad_accum
        if not self.batches_per_epoch:  # a stream: every step a full window; a pass holds at least one batch
            if self.samples_seen != self.step * self.samples_per_step:
                return f"samples_seen {self.samples_seen} is not step {self.step} x {self.samples_per_step} samples per step"
            if max(self.epoch, self.batch_in_epoch) > micro_batches:
                return (f"epoch {self.epoch} and batch_in_epoch {self.batch_in_epoch} lie beyond the {micro_batches} "
                        f"micro-batches of step {self.step}")
            return None
        if self.batch_in_epoch >= self.batches_per_epoch or self.batch_in_epoch % self.grad_accum:
            return (f"batch_in_epoch {self.batch_in_epoch} is not an optimizer-step boundary inside an epoch of "
                    f"{self.batches_per_epoch} batches (grad_accum {self.grad_accum})")
        steps_per_epoch = -(-self.batches_per_epoch // self.grad_accum)
        step = self.epoch * steps_per_epoch + self.batch_in_epoch // self.grad_accum
        if self.step != step:
            return (f"step {self.step} does not follow from epoch {self.epoch} and batch_in_epoch {self.batch_in_epoch} "
                    f"({steps_per_epoch} optimizer steps per epoch make step {step})")
        samples = (self.epoch * self.batches_per_epoch + self.batch_in_epoch) * self.global_batch_size
        if self.samples_seen != samples:
            return f"samples_seen {self.samples_seen} does not follow from its position in the data ({samples} samples)"
        return None


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return output_dir / CHECKPOINTS_DIR / f"step_{step:08d}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)
    descriptor = os.open(path, flags)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def save_checkpoint(accelerator, state: RunState, output_dir: Path, write_extra=None) -> Path:
    """``Accelerator.save_state`` into a temporary folder, then ``write_extra(folder)`` (the hooks' states),
    the trainer state and a manifest (size and sha256 of every file), fsync, and one atomic rename. A crash
    at any point leaves either no new checkpoint or a complete one; never a half-written ``step_*``.
    (``--async-checkpoint``: :mod:`acceltrain.async_checkpoint` stages and publishes the same way.)"""
    final, staging = staging_folder(accelerator, output_dir, state.step)
    with failed_save_refused(final, staging):
        accelerator.save_state(str(staging))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            write_run_files(staging, state, write_extra)
            publish(staging, final)
    accelerator.wait_for_everyone()
    return final


def staging_folder(accelerator, output_dir: Path, step: int) -> tuple[Path, Path]:
    """(the checkpoint's final folder, the empty temporary one it is written in), agreed by all processes."""
    final = checkpoint_dir(output_dir, step)
    staging = final.with_name(f".tmp-{final.name}")
    if accelerator.is_main_process and staging.exists():
        shutil.rmtree(staging)
    accelerator.wait_for_everyone()
    return final, staging


@contextlib.contextmanager
def failed_save_refused(final: Path, staging: Path):
    """A save that fails (a full disk) removes its temporary folder and is one line: the previous checkpoints are intact."""
    try:
        yield
    except (OSError, RuntimeError, ValueError) as err:  # torch reports a full disk from C++ as a RuntimeError
        shutil.rmtree(staging, ignore_errors=True)
        raise failed_save(final, err) from None


def failed_save(final: Path, err: BaseException) -> CheckpointError:
    way_out = "free space and continue with --resume auto" if _out_of_space(err) else "continue with --resume auto once it is mended"
    return CheckpointError(f"could not write checkpoint {str(final)!r}: {first_line(err)}; the previous checkpoints are intact ({way_out})")


def write_run_files(staging: Path, state: RunState, write_extra=None) -> None:
    """The main process's part beside Accelerate's: the hooks' states (``write_extra``) and the trainer state."""
    if write_extra is not None:
        write_extra(staging)
    (staging / STATE_FILE).write_text(json.dumps(dataclasses.asdict(state), indent=2))


def publish(staging: Path, final: Path) -> None:
    """Once every process's files are in ``staging``: the manifest (size and sha256 of every file), fsync, and
    one atomic rename to ``final``: the checkpoint exists complete, or not at all."""
    manifest = {}
    for file in sorted(p for p in staging.rglob("*") if p.is_file()):
        _fsync(file)
        manifest[str(file.relative_to(staging))] = {"bytes": file.stat().st_size, "sha256": _sha256(file)}
    (staging / COMPLETE_FILE).write_text(json.dumps(manifest, indent=1))
    _fsync(staging / COMPLETE_FILE)
    _fsync(staging)
    if final.exists():  # the same step saved before (e.g. a run resumed from an older checkpoint)
        shutil.rmtree(final)
    os.replace(staging, final)
    _fsync(final.parent)


def _out_of_space(err: Exception) -> bool:
    """A full disk or quota: ENOSPC/EDQUOT, or torch's C++ writer's "file write failed", which carries no errno."""
    if isinstance(err, OSError):
        return err.errno in (errno.ENOSPC, errno.EDQUOT)
    return "file write failed" in str(err) or "No space left" in str(err)


def verify_checkpoint(path: Path) -> tuple[RunState, dict[str, dict]]:
    """The checkpoint's run state and the hook states it keeps in it (:data:`MOVED_TO_HOOKS`), after checking
    every file against the manifest; else CheckpointError."""
    if not path.is_dir():
        raise CheckpointError(f"--resume {str(path)!r}: no such checkpoint folder")
    marker = path / COMPLETE_FILE
    if not marker.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: {COMPLETE_FILE} is missing (the save did not finish)")
    try:
        manifest = parse_json(marker.read_text())
    except (OSError, ValueError):
        raise CheckpointError(f"checkpoint file {str(marker)!r} is unreadable") from None
    for name, expected in _manifest_entries(manifest, marker):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {str(file)!r} is missing")
        if file.stat().st_size != expected["bytes"]:
            raise CheckpointError(f"checkpoint file {str(file)!r} is truncated ({file.stat().st_size} of {expected['bytes']} bytes)")
        if _sha256(file) != expected["sha256"]:
            raise CheckpointError(f"checkpoint file {str(file)!r} is corrupted (sha256 differs from the manifest)")
    state_file = path / STATE_FILE
    try:
        fields = parse_json(state_file.read_text())
    except (OSError, ValueError):
        raise CheckpointError(f"checkpoint file {str(state_file)!r} is unreadable") from None
    return _run_state(fields, state_file)


def _manifest_entries(manifest, marker: Path) -> list[tuple[str, dict]]:
    """The manifest's (file, {bytes, sha256}) entries, each checked for shape: a tampered manifest is one line."""
    def malformed(what: str) -> CheckpointError:
        return CheckpointError(f"checkpoint file {str(marker)!r} is malformed: {what}; it must map each file to its bytes and sha256")

    if not isinstance(manifest, dict):
        raise malformed(f"a JSON {type(manifest).__name__}, not an object")
    for name, entry in manifest.items():
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise malformed(f"entry {shorten(name)} points outside the checkpoint")
        if not (isinstance(entry, dict) and _is_count(entry.get("bytes")) and isinstance(entry.get("sha256"), str)):
            raise malformed(f"entry {shorten(name)} is {shorten(entry)}")
    return list(manifest.items())


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite_non_negative(value) -> bool:
    return _is_number(value) and math.isfinite(value) and value >= 0


# Checkpoints written before RunState (acceltrain 0.1) name one field otherwise, and keep two built-in
# hooks' states among the run's: they load as the hooks' states.
RENAMED_FIELDS = {"batches_in_epoch": "batch_in_epoch"}
MOVED_TO_HOOKS = {"best_checkpoint": ("CheckpointSchedule", "best_checkpoint"), "tracker_run_id": ("Trackers", "run_id")}

# What each trainer_state.json field may hold, as (test, what is allowed): a tampered value (a negative step,
# a string count) would otherwise train from it, or fail deep inside the loop.
_FIELD_CHECKS = {
    **{name: (_is_count, "an integer >= 0") for name in ("step", "epoch", "batch_in_epoch", "samples_seen", "seed",
                                                         "global_batch_size", "train_samples", "num_processes",
                                                         "batches_per_epoch", *RENAMED_FIELDS)},
    "grad_accum": (lambda v: _is_count(v) and v >= 1, "an integer >= 1"),
    "train_seconds": (_finite_non_negative, "a finite number >= 0"),
    "loss_count": (_finite_non_negative, "a finite number >= 0"),
    "loss_sum": (lambda v: _is_number(v) and math.isfinite(v), "a finite number"),
    "best_metric": (lambda v: v is None or _is_number(v), "a number or null"),
    **{name: (lambda v: v is None or isinstance(v, str), "a string or null") for name in (*MOVED_TO_HOOKS, "data_fingerprint")},
    **{name: (lambda v: isinstance(v, dict), "a JSON object") for name in ("last_eval", "scheduler", "config", "config_changes")},
    "hooks": (lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v), "a list of hook names"),
}
# Every trainer_state.json since acceltrain 0.1 holds these (0.2 added num_processes and batches_per_epoch, whose
# 0 means "not recorded", 0.3 data_fingerprint): a missing one is tampering, never a default (a step-4 checkpoint "at step 0").
REQUIRED_FIELDS = tuple(name for name in (field.name for field in dataclasses.fields(RunState))
                        if name not in ("num_processes", "batches_per_epoch", "data_fingerprint"))
# The settings that change the maths, in every checkpoint's config since 0.1: "config": {} would skip the comparison
REQUIRED_CONFIG = ("seed", "batch_size", "grad_accum", "epochs", "max_steps", "optimizer", "lr", "momentum", "weight_decay",
                   "lr_schedule", "warmup_steps", "max_grad_norm", "mixed_precision")


def _run_state(fields, state_file: Path) -> tuple[RunState, dict[str, dict]]:
    """``trainer_state.json``'s fields, every one checked for type and range, as a RunState and the hook
    states an older checkpoint keeps among them (by hook name)."""
    if not isinstance(fields, dict):
        raise CheckpointError(f"checkpoint file {str(state_file)!r} is malformed: a JSON {type(fields).__name__}, not an object")
    unknown = sorted(set(fields) - set(_FIELD_CHECKS))
    if unknown:
        raise CheckpointError(f"checkpoint file {str(state_file)!r} has unknown fields: {', '.join(shorten(name, 40) for name in unknown[:5])}")
    for name, value in fields.items():
        valid, allowed = _FIELD_CHECKS[name]
        if not valid(value):
            raise CheckpointError(f"checkpoint file {str(state_file)!r}: {name} is {shorten(value)}; it must be {allowed}")
    for old, new in RENAMED_FIELDS.items():
        if old in fields and new in fields:
            raise CheckpointError(f"checkpoint file {str(state_file)!r} has both {new} and {old}, its older name: keep one")
    named = {RENAMED_FIELDS.get(name, name) for name in fields}
    missing = [name for name in REQUIRED_FIELDS if name not in named]
    if missing:
        raise CheckpointError(f"checkpoint file {str(state_file)!r} lacks {', '.join(missing)}: every checkpoint since acceltrain 0.1 holds them")
    missing = [name for name in REQUIRED_CONFIG if name not in fields["config"]]
    if missing:
        raise CheckpointError(f"checkpoint file {str(state_file)!r}: config lacks {', '.join(missing[:5])}: it must hold the resolved "
                              "config the checkpoint was written with (a resume compares it)")
    hook_states: dict[str, dict] = {}
    for field, (hook, key) in MOVED_TO_HOOKS.items():
        if field in fields:
            hook_states.setdefault(hook, {})[key] = fields.pop(field)
    state = RunState(**{RENAMED_FIELDS.get(name, name): value for name, value in fields.items()})
    contradiction = state.contradiction()
    if contradiction:
        raise CheckpointError(f"checkpoint file {str(state_file)!r} contradicts itself: {contradiction}")
    return state, hook_states


def checkpoint_engine(path: Path) -> str:
    """The engine whose layout ``Accelerator.save_state`` wrote the model and optimizer in: "DeepSpeed" (the
    engine's own ``pytorch_model/`` folder), "FSDP" (``pytorch_model_fsdp*``), else "DDP" (whole state dicts, as
    DDP and one process write them). Each loads only under its own engine."""
    if (path / "pytorch_model").is_dir():
        return "DeepSpeed"
    if any(path.glob("pytorch_model_fsdp*")):
        return "FSDP"
    return "DDP"


def check_scheduler_state(saved: dict, fresh: dict, step: int, path: Path) -> None:
    """A checkpoint's LR-scheduler state must look like this run's fresh one (the same keys, lengths and kinds of
    value) and count at most ``step`` steps: torch's ``load_state_dict`` takes any dict, and an edited one fails
    later, deep inside torch (``KeyError: 'lr_lambdas'``), or trains on another schedule."""
    problem = _unlike(saved, fresh, "scheduler")
    if problem is None and not 0 <= saved["last_epoch"] <= step:
        problem = f"scheduler.last_epoch is {saved['last_epoch']}; it must be in [0, {step}], the steps taken"
    if problem:
        raise CheckpointError(f"checkpoint file {str(path / STATE_FILE)!r}: {problem}")


def _unlike(saved, fresh, where: str) -> str | None:
    """Where ``saved`` (read from JSON) differs in shape from ``fresh`` (a state_dict), or None."""
    if isinstance(fresh, dict):
        if not isinstance(saved, dict) or set(saved) != set(fresh):
            keys = sorted(saved) if isinstance(saved, dict) else saved
            return f"{where} is {shorten(keys)}; it must have the keys {', '.join(map(str, sorted(fresh)))}"
        return next((found for key in fresh if (found := _unlike(saved[key], fresh[key], f"{where}.{key}"))), None)
    if isinstance(fresh, (list, tuple)):
        if not isinstance(saved, list) or len(saved) != len(fresh):
            return f"{where} is {shorten(saved)}; it must be a list of {len(fresh)}"
        return next((found for i, item in enumerate(fresh) if (found := _unlike(saved[i], item, f"{where}[{i}]"))), None)
    if _is_number(fresh):
        if not (_is_number(saved) and math.isfinite(saved)) or (isinstance(fresh, int) and not isinstance(saved, int)):
            return f"{where} is {shorten(saved)}; it must be a finite {'integer' if isinstance(fresh, int) else 'number'}"
        return None
    if type(saved) is not type(fresh):
        return f"{where} is {shorten(saved)}; it must be {shorten(fresh)}"
    return None


_CHECKPOINT_NAME = re.compile(r"step_(\d+)")


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """``step_<N>`` folders that carry a manifest, oldest first (by step, not by name or mtime). Anything
    else in the folder (``step_10.bak``, your notes) is not a checkpoint and is left alone."""
    folder = output_dir / CHECKPOINTS_DIR
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if _CHECKPOINT_NAME.fullmatch(p.name) and p.is_dir() and (p / COMPLETE_FILE).is_file()]
    return sorted(found, key=lambda p: int(_CHECKPOINT_NAME.fullmatch(p.name).group(1)))


PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".pkl")


def _allowed_globals() -> list:
    """The only classes a checkpoint's pickles may name: numpy arrays (RNG states) and, with DeepSpeed, its
    ZeRO stage enum, loss scaler and fragment addresses. Anything else would run code to load."""
    import numpy

    multiarray = getattr(numpy, "_core", None) or numpy.core  # numpy 2 renamed numpy.core
    allowed = [numpy.dtype, numpy.ndarray, multiarray.multiarray._reconstruct]
    allowed += [type(numpy.dtype(name)) for name in ("uint32", "int64", "float64", "bool")]  # numpy >= 1.25 dtype classes
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.utils.tensor_fragment import fragment_address

        allowed += [LossScaler, DynamicLossScaler, fragment_address]
    except ImportError:
        pass
    enums = allowed_enums()
    return [*allowed, *enums, (enum_member_getter(enums), "builtins.getattr")]


def allowed_enums() -> tuple:
    """The Enum classes a checkpoint may hold members of: DeepSpeed's ZeRO stage, when DeepSpeed is installed."""
    try:
        from deepspeed.runtime.zero.config import ZeroStageEnum
    except ImportError:
        return ()
    return (ZeroStageEnum,)


def enum_member_getter(enums: tuple):
    """What the GLOBAL ``builtins.getattr`` resolves to in a checkpoint's pickles. Some Pythons (3.11.2)
    pickle an Enum member as ``getattr(EnumClass, name)``; this getattr returns members of ``enums`` only,
    and refuses any other attribute of anything."""
    import pickle

    def member(owner, name):
        if owner in enums and isinstance(name, str) and name in owner.__members__:
            return owner[name]
        raise pickle.UnpicklingError(f"getattr({getattr(owner, '__name__', owner)!r}, {name!r}) is not an allowed enum member")

    return member


DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of a sharded (FSDP) state (or __<rank>.metadata)


def check_loadable_without_code(path: Path) -> None:
    """Load every pickle of checkpoint ``path`` with ``weights_only=True`` and only the allowed globals: a
    file that would run code (a planted pickle, whatever its sha256 says) or does not load is a one-line
    CheckpointError, before Accelerate sees it (it skips an unloadable RNG file with a log line). FSDP's
    sharded folders included: DCP reads their ``.metadata`` with plain ``pickle``, so it is checked here
    with an unpickler that knows only DCP's own classes, then every item it points to in the ``.distcp``
    files. (The check reads each file once more than the resume does.)"""
    import torch

    links = sorted(str(f.relative_to(path)) for f in path.rglob("*") if f.is_symlink())
    if links:  # rglob does not walk into linked folders, the loaders would: a place for files this check never sees
        raise CheckpointError(f"checkpoint {str(path)!r} holds symbolic links ({', '.join(links[:3])}); refusing to resume from it")
    with torch.serialization.safe_globals(_allowed_globals()):
        for file in sorted(f for f in path.rglob("*") if (f.suffix in PICKLED_SUFFIXES or f.name.endswith(DCP_METADATA)) and f.is_file()):
            if file.name.endswith(DCP_METADATA):  # DCP falls back to __<rank>.metadata when .metadata is missing
                _check_dcp_folder(file)
                continue
            with _refusing(file):
                torch.load(file, map_location="cpu", weights_only=True)


@contextlib.contextmanager
def _refusing(file: Path):
    """Any failure inside is the one-line refusal to resume, naming ``file``."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - UnpicklingError, EOFError, RuntimeError: all the same verdict
        raise CheckpointError(
            f"checkpoint file {str(file)!r} cannot be loaded without running code or is unreadable ({first_line(err, 200)}); "
            "refusing to resume from it"
        ) from None


def _check_dcp_folder(metadata_file: Path) -> None:
    import io

    import torch

    with _refusing(metadata_file):
        storage = _load_dcp_metadata(metadata_file).storage_data
        items = [(metadata_file.parent / info.relative_path, info.offset, info.length) for info in storage.values()]
    for file, offset, length in items:
        with _refusing(file), open(file, "rb") as stream:
            stream.seek(offset)
            item = io.BytesIO(stream.read(length))
            torch.load(item, map_location="cpu", weights_only=True)


def _load_dcp_metadata(file: Path):
    """DCP's ``.metadata`` pickle, allowing only the names it holds: DCP's metadata classes, torch sizes,
    dtypes and layouts, and the checkpoint's path. Python's own unpickler, since DCP pickles with protocol 4+
    (framing), which torch's weights-only unpickler does not read; BUILD may only set the state of instances
    of those classes, never of a class or function itself (that would change it for the whole process)."""
    import enum
    import pathlib
    import pickle

    import torch
    from torch.distributed.checkpoint import filesystem, metadata

    allowed = {f"torch.distributed.checkpoint.metadata.{name}": getattr(metadata, name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata", "ChunkStorageMetadata",
        "BytesStorageMetadata", "_MEM_FORMAT_ENCODING") if hasattr(metadata, name)}
    allowed |= {"torch.distributed.checkpoint.filesystem._StorageInfo": filesystem._StorageInfo, "torch.Size": torch.Size,
                "torch.serialization._get_layout": torch.serialization._get_layout, "pathlib.PosixPath": pathlib.PosixPath}
    allowed |= {f"torch.{name}": value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
    enums = tuple(value for value in allowed.values() if isinstance(value, type) and issubclass(value, enum.Enum))
    allowed["builtins.getattr"] = enum_member_getter(enums)  # _MEM_FORMAT_ENCODING's members on Python 3.11.2

    instances = tuple(value for value in allowed.values() if isinstance(value, type) and not issubclass(value, enum.Enum))

    class OnlyMetadata(pickle._Unpickler):  # the Python implementation: its opcodes can be screened one by one
        dispatch = dict(pickle._Unpickler.dispatch)

        def find_class(self, module: str, name: str):
            if f"{module}.{name}" not in allowed:
                raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")
            return allowed[f"{module}.{name}"]

        def load_build(self):
            if type(self.stack[-2]) not in instances:  # [-1] is the state, [-2] what it would be set on
                raise pickle.UnpicklingError(f"BUILD on a {type(self.stack[-2]).__name__} is not allowed in DCP metadata")
            pickle._Unpickler.load_build(self)

        dispatch[pickle.BUILD[0]] = load_build

    with open(file, "rb") as stream:
        return OnlyMetadata(stream).load()


@contextlib.contextmanager
def loading_without_code():
    """Inside: every ``torch.load`` (Accelerate's, DeepSpeed's checkpoint engine, which asks for
    ``weights_only=False``) loads with ``weights_only=True`` and only the allowed globals."""
    import torch

    original = torch.load

    def load(*args, **kwargs):
        kwargs["weights_only"] = True
        return original(*args, **kwargs)

    with torch.serialization.safe_globals(_allowed_globals()):
        torch.load = load
        try:
            yield
        finally:
            torch.load = original


def find_resume_checkpoint(resume: str, output_dir: Path, warn) -> tuple[Path, RunState, dict[str, dict]] | None:
    """``--resume PATH``: that checkpoint or a one-line error. ``--resume auto``: the newest checkpoint
    that verifies, warning about (and skipping) newer broken ones; None when there is none. With the
    checkpoint: its run state and the hook states kept in it (see :func:`verify_checkpoint`)."""
    if resume != "auto":
        path = Path(resume)
        return path, *verify_checkpoint(path)
    candidates = list(reversed(complete_checkpoints(output_dir)))
    for path in candidates:
        try:
            return path, *verify_checkpoint(path)
        except CheckpointError as err:
            warn(f"skipping checkpoint: {err}")
    return None


def rotate_checkpoints(output_dir: Path, keep_last: int | None, best: str | None, verified: set[str]) -> list[Path]:
    """Delete leftovers of interrupted saves, and complete checkpoints older than the newest ``keep_last``
    ones that verify, never the best one. A broken checkpoint never counts as one of the newest (it
    would push good ones out); a broken one newer than those kept is left for ``--resume auto`` to skip
    and name. ``verified``: names known good (written by this run, or checked before); extended here,
    so each checkpoint is hashed at most once per run. Returns what was deleted."""
    deleted = []
    for leftover in (output_dir / CHECKPOINTS_DIR).glob(".tmp-step_*"):
        shutil.rmtree(leftover, ignore_errors=True)
        deleted.append(leftover)
    if keep_last is None:
        return deleted
    kept = 0
    for path in reversed(complete_checkpoints(output_dir)):
        if kept < keep_last:
            if path.name not in verified:
                try:
                    verify_checkpoint(path)
                except CheckpointError:
                    continue
                verified.add(path.name)
            kept += 1
        elif path.name != best:
            shutil.rmtree(path)
            deleted.append(path)
    return deleted


class PreemptionSignals:
    """SIGTERM and SIGUSR1 (what schedulers send before killing a job) and a first SIGINT (Ctrl-C) set a flag
    that the loop reads at the next optimizer-step boundary; a second SIGTERM only sets it again, so a save
    in progress finishes, while a second Ctrl-C raises KeyboardInterrupt: the way to abort at once."""

    SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1", "SIGINT") if hasattr(signal, name))

    def __init__(self):
        self.received: int | None = None
        self._previous = {}

    def install(self) -> "PreemptionSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    @property
    def name(self) -> str | None:
        return signal.Signals(self.received).name if self.received is not None else None

    @property
    def exit_code(self) -> int:
        return EXIT_INTERRUPTED if self.received == signal.SIGINT else EXIT_PREEMPTED

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def ignore_further(self) -> None:
        """On the way out after a stop: ignore more SIGTERM/SIGUSR1. A Python handler would be reset to the
        default (kill) during interpreter shutdown, turning a clean exit 75 into death by SIGTERM."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                if sig != signal.SIGINT:
                    signal.signal(sig, signal.SIG_IGN)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def ignore_stop_signals(worker_id: int = 0) -> None:
    """A DataLoader worker's ``worker_init_fn``: leave SIGTERM, SIGUSR1 and SIGINT to the main process. A
    signal sent to the whole process group (SLURM, ``scancel``, ``docker stop``, Ctrl-C) would otherwise kill
    the workers first and crash the run before it can save."""
    for sig in PreemptionSignals.SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
