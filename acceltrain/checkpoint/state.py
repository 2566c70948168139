"""A checkpoint's ``trainer_state.json``: the :class:`RunState` schema, and its validation as untrusted input
(every field checked for type and range, fields that contradict each other refused, the scheduler state shaped
like this run's) before anything trains from it."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from acceltrain.config.options import ConfigError, parse_json, shorten
from acceltrain.engines import CHECKPOINT_FORMATS

STATE_FILE = "trainer_state.json"  # a checkpoint's RunState
FORMAT_VERSION = 1  # trainer_state.json's format: a newer one is refused; an older one goes through migrate()


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed from (incomplete, truncated, corrupted, of another run)."""


@dataclasses.dataclass
class RunState:
    """Where a run stands: with Accelerate's state (model, optimizer, grad scaler, RNG) and the hooks'
    ``state_dict()``, all that survives a resume. The :class:`~acceltrain.train.run.Run` keeps one current as it
    trains, and a checkpoint's ``trainer_state.json`` is it, taken at a step boundary: one set of names in
    memory and on disk. The data order and the augmentation need nothing more: both derive from (seed,
    epoch, index)."""

    format_version: int = FORMAT_VERSION
    # kept current as the run trains
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0  # per-process batches of ``epoch`` already trained on
    samples_seen: int = 0
    best_metric: float | None = None
    last_eval: dict = dataclasses.field(default_factory=dict)
    config_changes: dict = dataclasses.field(
        default_factory=dict
    )  # applied with --allow-config-change: field -> [old, new]
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
    data_fingerprint: str | None = None  # the training set's fingerprint, when it has one
    num_processes: int = 1
    batches_per_epoch: int = 0  # per process; 0: a stream, whose passes end when the stream does
    engine: str = "DDP"  # the checkpoint format of the engine that wrote the model and optimizer state

    @property
    def samples_per_step(self) -> int:
        return self.global_batch_size * self.grad_accum

    def layout(self) -> str:
        batch = self.global_batch_size // self.num_processes
        return (
            f"{self.num_processes} processes x batch {batch} x grad_accum {self.grad_accum} = {self.samples_per_step} "
            "samples per optimizer step"
        )

    def check_compatible(self, current: RunState, path: Path) -> None:
        """Refuse what would not continue the same run. Another layout (process count, batch size,
        accumulation) continues it when every optimizer step covers the same samples: equal samples per
        step and per epoch (so the same steps per epoch, the same short last window)."""
        if (
            None not in (self.data_fingerprint, current.data_fingerprint)
            and self.data_fingerprint != current.data_fingerprint
        ):
            raise CheckpointError(
                f"checkpoint {str(path)!r} was trained on data whose fingerprint is "
                f"{shorten(self.data_fingerprint, 24)}, this run's training data has "
                f"{shorten(current.data_fingerprint, 24)}: its content changed since; resuming would not continue the "
                "same run: restore the data, or start a new --output-dir"
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
        if not self.batches_per_epoch:
            raise CheckpointError(
                f"checkpoint {str(path)!r} was written with {self.layout()}, this run has {current.layout()}, and it "
                "trained on a stream, whose loader position is recorded per layout: resume with its layout"
            )
        if self.samples_per_step != current.samples_per_step:
            per_process = current.global_batch_size  # batch size x processes of this run
            fit = (
                f" (here: --grad-accum {self.samples_per_step // per_process})"
                if self.samples_per_step % per_process == 0
                else ""
            )
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

    def relayout(self, current: RunState) -> bool:
        """Whether ``current`` trains on another layout than this checkpoint's."""
        return (self.global_batch_size, self.grad_accum, self.num_processes) != (
            current.global_batch_size,
            current.grad_accum,
            current.num_processes,
        )

    def in_layout(self, current: RunState) -> RunState:
        """This state as the layout of ``current`` counts it: the same samples of the epoch trained on (a
        checkpoint sits at a step boundary, a whole number of this run's micro-steps), the new layout's fields."""
        position = self.batch_in_epoch * self.global_batch_size // current.global_batch_size
        layout = {
            name: getattr(current, name)
            for name in ("global_batch_size", "grad_accum", "num_processes", "batches_per_epoch")
        }
        return dataclasses.replace(self, batch_in_epoch=position, **layout)

    def contradiction(self) -> str | None:
        """What in these fields contradicts the rest (a hand-edited trainer_state.json), or None. A checkpoint
        sits at an optimizer-step boundary, so its place in the data and its sample count follow from its step."""
        micro_batches = self.step * self.grad_accum
        if not self.batches_per_epoch:  # a stream: every step a full window; a pass holds at least one batch
            if self.samples_seen != self.step * self.samples_per_step:
                return (
                    f"samples_seen {self.samples_seen} is not step {self.step} x {self.samples_per_step} samples per "
                    "step"
                )
            if max(self.epoch, self.batch_in_epoch) > micro_batches:
                return (
                    f"epoch {self.epoch} and batch_in_epoch {self.batch_in_epoch} lie beyond the {micro_batches} "
                    f"micro-batches of step {self.step}"
                )
            return None
        if self.batch_in_epoch >= self.batches_per_epoch or self.batch_in_epoch % self.grad_accum:
            return (
                f"batch_in_epoch {self.batch_in_epoch} is not an optimizer-step boundary inside an epoch of "
                f"{self.batches_per_epoch} batches (grad_accum {self.grad_accum})"
            )
        steps_per_epoch = -(-self.batches_per_epoch // self.grad_accum)
        step = self.epoch * steps_per_epoch + self.batch_in_epoch // self.grad_accum
        if self.step != step:
            return (
                f"step {self.step} does not follow from epoch {self.epoch} and batch_in_epoch {self.batch_in_epoch} "
                f"({steps_per_epoch} optimizer steps per epoch make step {step})"
            )
        samples = (self.epoch * self.batches_per_epoch + self.batch_in_epoch) * self.global_batch_size
        if self.samples_seen != samples:
            return f"samples_seen {self.samples_seen} does not follow from its position in the data ({samples} samples)"
        return None


def is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite_non_negative(value) -> bool:
    return _is_number(value) and math.isfinite(value) and value >= 0


# What each trainer_state.json field may hold, as (test, what is allowed): a tampered value (a negative step,
# a string count) would otherwise train from it, or fail deep inside the loop.
_FIELD_CHECKS = {
    **{
        name: (is_count, "an integer >= 0")
        for name in (
            "step",
            "epoch",
            "batch_in_epoch",
            "samples_seen",
            "seed",
            "global_batch_size",
            "train_samples",
            "batches_per_epoch",
        )
    },
    "format_version": (lambda v: is_count(v) and v >= 1, "an integer >= 1"),
    "num_processes": (lambda v: is_count(v) and v >= 1, "an integer >= 1"),
    "grad_accum": (lambda v: is_count(v) and v >= 1, "an integer >= 1"),
    "train_seconds": (_finite_non_negative, "a finite number >= 0"),
    "loss_count": (_finite_non_negative, "a finite number >= 0"),
    "loss_sum": (lambda v: _is_number(v) and math.isfinite(v), "a finite number"),
    "best_metric": (lambda v: v is None or _is_number(v), "a number or null"),
    **{name: (lambda v: v is None or isinstance(v, str), "a string or null") for name in ("data_fingerprint",)},
    **{
        name: (lambda v: isinstance(v, dict), "a JSON object")
        for name in ("last_eval", "scheduler", "config", "config_changes")
    },
    "hooks": (lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v), "a list of hook names"),
    "engine": (lambda v: v in CHECKPOINT_FORMATS, f"one of {', '.join(map(repr, CHECKPOINT_FORMATS))}"),
}
# Every field is in every trainer_state.json of this format: a missing one is tampering, never a default (a step-4
# checkpoint "at step 0").
REQUIRED_FIELDS = tuple(field.name for field in dataclasses.fields(RunState))
# The settings that change the maths, in every checkpoint's config: "config": {} would skip the comparison
REQUIRED_CONFIG = (
    "seed",
    "batch_size",
    "grad_accum",
    "epochs",
    "max_steps",
    "optimizer",
    "lr",
    "momentum",
    "weight_decay",
    "lr_schedule",
    "warmup_steps",
    "max_grad_norm",
    "mixed_precision",
)


def migrate(fields: dict, state_file: Path) -> dict:
    """``trainer_state.json``'s fields in this acceltrain's format (:data:`FORMAT_VERSION`): a newer format is refused
    in one line; an older one is brought up to date here, one step per version, when a release changes the format
    (none has yet: 1 is the first)."""
    version = fields.get("format_version")
    if not is_count(version) or version < 1:
        raise CheckpointError(
            f"checkpoint file {str(state_file)!r}: format_version is {shorten(version)}; it must be an integer >= 1 "
            "(a checkpoint of a development build before the first release has none: start a new --output-dir)"
        )
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint file {str(state_file)!r} is of format {version}, written by a newer acceltrain; this one "
            f"reads format {FORMAT_VERSION} and older: upgrade acceltrain to resume it"
        )
    return fields


def read_state(state_file: Path) -> RunState:
    """``trainer_state.json``'s fields, migrated to this format, every one checked for type and range."""
    try:
        fields = parse_json(state_file.read_text())
    except (OSError, ValueError):
        raise CheckpointError(f"checkpoint file {str(state_file)!r} is unreadable") from None
    if not isinstance(fields, dict):
        raise CheckpointError(
            f"checkpoint file {str(state_file)!r} is malformed: a JSON {type(fields).__name__}, not an object"
        )
    fields = migrate(fields, state_file)
    unknown = sorted(set(fields) - set(_FIELD_CHECKS))
    if unknown:
        raise CheckpointError(
            f"checkpoint file {str(state_file)!r} has unknown fields: "
            f"{', '.join(shorten(name, 40) for name in unknown[:5])}"
        )
    for name, value in fields.items():
        valid, allowed = _FIELD_CHECKS[name]
        if not valid(value):
            raise CheckpointError(
                f"checkpoint file {str(state_file)!r}: {name} is {shorten(value)}; it must be {allowed}"
            )
    missing = [name for name in REQUIRED_FIELDS if name not in fields]
    if missing:
        raise CheckpointError(
            f"checkpoint file {str(state_file)!r} lacks {', '.join(missing)}: every checkpoint holds them"
        )
    missing = [name for name in REQUIRED_CONFIG if name not in fields["config"]]
    if missing:
        raise CheckpointError(
            f"checkpoint file {str(state_file)!r}: config lacks {', '.join(missing[:5])}: it must hold the resolved "
            "config the checkpoint was written with (a resume compares it)"
        )
    state = RunState(**fields)
    contradiction = state.contradiction()
    if contradiction:
        raise CheckpointError(f"checkpoint file {str(state_file)!r} contradicts itself: {contradiction}")
    return state


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
        return next(
            (found for i, item in enumerate(fresh) if (found := _unlike(saved[i], item, f"{where}[{i}]"))), None
        )
    if _is_number(fresh):
        if not (_is_number(saved) and math.isfinite(saved)) or (isinstance(fresh, int) and not isinstance(saved, int)):
            return (
                f"{where} is {shorten(saved)}; it must be a finite {'integer' if isinstance(fresh, int) else 'number'}"
            )
        return None
    if type(saved) is not type(fresh):
        return f"{where} is {shorten(saved)}; it must be {shorten(fresh)}"
    return None
