"""The typed training config: the single source of truth for CLI flags, YAML presets and trackers.

A recipe subclasses :class:`TrainConfig` to add its own fields (model, dataset, ...). Every field
becomes a kebab-case flag (``batch_size`` -> ``--batch-size``) whose help text is the field's
``help`` metadata. Precedence: dataclass default < ``--config`` YAML preset < explicit CLI flag.
Validation runs before anything heavy (no process group, no output folder, no data).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from .options import (  # noqa: F401 (ConfigError, option, require, ...: also importable from here, their first home)
    CheckpointOptions,
    ConfigError,
    EarlyStoppingOptions,
    EvaluationOptions,
    HubOptions,
    LoggingOptions,
    Options,
    PlotOptions,
    ProfilingOptions,
    ReportTo,
    TimeBudgetOptions,
    TrackingOptions,
    WandbMode,
    check_option_groups,
    first_line,
    flag_name,
    option,
    parse_step_range,
    read_small_file,
    require,
    shorten,
)

__all__ = [
    "CompileMode",
    "ConfigError",
    "LRSchedule",
    "LogLevel",
    "LoopOptions",
    "MixedPrecision",
    "Optimizer",
    "Options",
    "ReportTo",
    "ScaleLR",
    "TrainConfig",
    "WandbMode",
    "build_parser",
    "flag_name",
    "load_yaml_preset",
    "option",
    "parse_config",
    "parse_step_range",
    "require",
    "run_changes",
]

MixedPrecision = Literal["no", "fp16", "bf16"]
LRSchedule = Literal["constant", "cosine", "linear"]
Optimizer = Literal["sgd", "adamw", "muon"]
CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
ScaleLR = Literal["none", "linear"]
LogLevel = Literal["debug", "info", "warning", "error"]


@dataclasses.dataclass
class LoopOptions(Options):
    """The loop's own settings: length and batch, optimizer and schedule, hardware, the speed toolkit,
    resuming and outputs. Each built-in hook's settings are its own group (:mod:`acceltrain.options`)."""

    config: str | None = option(None, "YAML preset to load; explicit flags override its values", free_on_resume=True)
    # -- length and batch
    batch_size: int = option(128, "micro-batch size per process (an epoch's last incomplete batch is dropped)")
    grad_accum: int = option(1, "micro-batches accumulated per optimizer step")
    epochs: float = option(1.0, "epochs to train when --max-steps is not given")
    max_steps: int | None = option(None, "optimizer steps to train; overrides --epochs")
    # -- optimizer and schedule
    optimizer: Optimizer = option(
        "sgd",
        "sgd (Nesterov momentum), adamw (torch's fused kernel), or muon: torch.optim.Muon on the hidden weight matrices and conv kernels, "
        "SGD on embeddings, the head, biases and normalisation (airbench94_muon)",
    )
    lr: float = option(0.1, "peak learning rate")
    momentum: float = option(0.9, "SGD momentum")
    weight_decay: float = option(5e-4, "weight decay (decoupled for adamw)")
    muon_lr: float = option(
        0.02, "--optimizer muon: Muon's peak learning rate (the schedule scales it as it scales --lr)"
    )
    muon_momentum: float = option(0.95, "--optimizer muon: Muon's (Nesterov) momentum")
    muon_weight_decay: float = option(0.0, "--optimizer muon: Muon's decoupled weight decay")
    decay_all_parameters: bool = option(
        False,
        "weight decay on biases and normalisation parameters too, at the weights' decay per step (airbench94); "
        "default: matrices and conv kernels only",
    )
    norm_bias_lr_scale: float = option(
        1.0, "learning-rate multiplier for the normalisation layers' parameters (airbench94: 64)"
    )
    lr_schedule: LRSchedule = option(
        "cosine",
        "after warm-up: constant, cosine decay to 0, or linear decay to 0 (its old name onecycle is accepted)",
        aliases={"onecycle": "linear"},
    )
    warmup_steps: int = option(0, "optimizer steps of linear learning-rate warm-up")
    warmup_start_rate: float = option(
        0.0, "the warm-up rises linearly from this fraction of the peak lr (airbench94: 0.2)"
    )
    min_lr_rate: float = option(
        0.0, "the decay ends at this fraction of the peak lr (transformers' min_lr_rate; airbench94: 0.07)"
    )
    max_grad_norm: float | None = option(None, "clip the global gradient norm to this on optimizer steps")
    # -- hardware and precision
    mixed_precision: MixedPrecision | None = option(
        None, "no, fp16 (CUDA only) or bf16; default: what the accelerate config says"
    )
    cpu: bool = option(False, "train on CPU even when an accelerator is present", free_on_resume=True)
    sync_bn: bool = option(False, "convert BatchNorm to SyncBatchNorm under DDP (no-op on 1 process)")
    # -- speed toolkit
    compile: bool = option(
        False,
        "torch.compile the model before the DDP wrap; compile time is reported apart, not in throughput",
        free_on_resume=True,
    )
    compile_mode: CompileMode = option("default", "torch.compile mode", free_on_resume=True)
    channels_last: bool = option(
        False, "channels_last memory format for the model and image batches (conv nets)", free_on_resume=True
    )
    activation_checkpointing: bool = option(
        False,
        "recompute activations in backward (ResNet blocks, Hugging Face models): less memory, more time",
        free_on_resume=True,
    )
    data_on_device: bool = option(
        False,
        "keep the uint8 training images on the training device and augment there in batch (image datasets)",
        free_on_resume=True,
    )
    auto_batch_size: bool = option(
        False,
        "probe from --batch-size down, halving on out-of-memory, and train with the largest that fits",
        free_on_resume=True,
    )
    keep_effective_batch: bool = option(
        True, "with --auto-batch-size: raise --grad-accum to keep batch x grad-accum", free_on_resume=True
    )
    scale_lr: ScaleLR = option(
        "none", "when the effective batch changes: none, or linear (lr x new/old batch)", free_on_resume=True
    )
    num_workers: int | None = option(
        None, "DataLoader workers per process (default: the CPUs per process less one, at most 8)", free_on_resume=True
    )
    prefetch_factor: int = option(4, "batches each DataLoader worker prepares ahead", free_on_resume=True)
    pin_memory: bool | None = option(
        None, "pin host memory for faster copies (default: on when training on CUDA)", free_on_resume=True
    )
    peak_tflops: float | None = option(
        None, "peak TFLOP/s of one device, for MFU on devices missing from the built-in table", free_on_resume=True
    )
    # -- resuming
    resume: str | None = option(
        None,
        "'auto': the newest complete checkpoint in --output-dir (none yet: start fresh); or a checkpoint folder",
        free_on_resume=True,
    )
    # -- reproducibility and outputs
    seed: int = option(0, "seed for weights, data order and augmentation")
    output_dir: str | None = option(None, "where outputs go (default: runs/<recipe>-<timestamp>)", free_on_resume=True)
    overwrite: bool = option(
        False,
        "start a new run in an --output-dir that holds an earlier one; that one is moved aside to <dir>.overwritten-<time>",
        free_on_resume=True,
    )
    allow_config_change: bool = option(
        False,
        "with --resume: apply settings that differ from the checkpoint's (recorded as config_changes) instead of refusing",
        free_on_resume=True,
    )
    timing_warmup_steps: int = option(
        5, "optimizer steps excluded from the throughput figure (warm-up, allocator, compile)", free_on_resume=True
    )
    log_level: LogLevel = option(
        "info",
        "the toolkit's messages from this level up (warning: no config, metric rows or 'done:'; the progress bar "
        "follows --progress); debug adds time and logger name and lets the libraries' warnings through",
        free_on_resume=True,
    )

    def validate(self) -> None:
        super().validate()
        for name in ("batch_size", "grad_accum"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "an integer >= 1")
        require(self.epochs > 0, "epochs", self.epochs, "a number > 0")
        if self.max_steps is not None:
            require(self.max_steps >= 1, "max_steps", self.max_steps, "an integer >= 1")
        require(self.lr > 0, "lr", self.lr, "a number > 0")
        require(self.weight_decay >= 0, "weight_decay", self.weight_decay, "a number >= 0")
        require(self.norm_bias_lr_scale > 0, "norm_bias_lr_scale", self.norm_bias_lr_scale, "a number > 0")
        require(0 <= self.momentum < 1, "momentum", self.momentum, "a number in [0, 1)")
        require(self.muon_lr > 0, "muon_lr", self.muon_lr, "a number > 0")
        require(0 <= self.muon_momentum < 1, "muon_momentum", self.muon_momentum, "a number in [0, 1)")
        require(self.muon_weight_decay >= 0, "muon_weight_decay", self.muon_weight_decay, "a number >= 0")
        require(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "an integer >= 0")
        for name in ("warmup_start_rate", "min_lr_rate"):
            require(0 <= getattr(self, name) < 1, name, getattr(self, name), "a number in [0, 1)")
        require(self.timing_warmup_steps >= 0, "timing_warmup_steps", self.timing_warmup_steps, "an integer >= 0")
        if self.max_grad_norm is not None:
            require(self.max_grad_norm > 0, "max_grad_norm", self.max_grad_norm, "a number > 0")
        if self.resume is not None and self.overwrite:
            raise ConfigError("--overwrite starts a new run and --resume continues one: give only one of them")
        if self.resume == "auto" and self.output_dir is None:
            raise ConfigError("--resume auto needs --output-dir: the run folder whose checkpoints to continue from")
        require(self.prefetch_factor >= 1, "prefetch_factor", self.prefetch_factor, "an integer >= 1")
        require(0 <= self.seed <= 2**32 - 1, "seed", self.seed, "an integer in [0, 4294967295]")  # numpy's range
        if self.peak_tflops is not None:
            require(self.peak_tflops > 0, "peak_tflops", self.peak_tflops, "a number > 0")
        if self.num_workers is not None:
            require(self.num_workers >= 0, "num_workers", self.num_workers, "an integer >= 0")


@dataclasses.dataclass
class TrainConfig(
    HubOptions,
    TrackingOptions,
    PlotOptions,
    LoggingOptions,
    CheckpointOptions,
    ProfilingOptions,
    TimeBudgetOptions,
    EarlyStoppingOptions,
    EvaluationOptions,
    LoopOptions,
):
    """Settings every recipe shares: the loop's own, then each built-in hook's group, in this order in
    ``--help`` (a dataclass lists its bases' fields from the last base to the first). A recipe subclasses
    it to add its own fields; ``validate`` checks every group."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


PRESETS = Path(__file__).parent / "recipes" / "configs"  # the presets shipped with the package (--config NAME)
LAYOUT_FIELDS = ("batch_size", "grad_accum")  # checked as a layout on resume (samples per optimizer step)


def run_changes(saved: dict[str, Any], cfg: TrainConfig, *, layout_free: bool = False) -> dict[str, list]:
    """The fields of ``cfg`` that change the run's maths and differ from ``saved`` (a checkpoint's resolved
    config): ``{field: [old, new]}``. Fields marked ``free_on_resume`` (speed, logging, outputs, schedules
    of saves and evaluations) may differ; fields the checkpoint does not know are not compared;
    ``layout_free``: nor :data:`LAYOUT_FIELDS`, which the checkpoint's layout check has passed."""
    changes = {}
    for field in dataclasses.fields(cfg):
        if (
            field.metadata.get("free_on_resume")
            or field.name not in saved
            or (layout_free and field.name in LAYOUT_FIELDS)
        ):
            continue
        now = getattr(cfg, field.name)
        old = field.metadata.get("aliases", {}).get(saved[field.name], saved[field.name])  # written under an old name
        if old != now:
            changes[field.name] = [old, now]
    return changes


# --------------------------------------------------------------------------- parsing


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """``int | None`` -> (int, True); ``int`` -> (int, False)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _field_kind(cls: type, field: dataclasses.Field) -> tuple[Any, tuple[str, ...] | None, bool, bool, dict]:
    """(base type, allowed choices, optional, list-like, aliases) of a config field, from its annotation and
    metadata. A list-like field (``list_like=True``: comma-separated values) also takes a YAML list."""
    hints = typing.get_type_hints(cls)
    base, optional = _unwrap_optional(hints[field.name])
    choices = field.metadata.get("choices")
    if typing.get_origin(base) is Literal:
        choices = tuple(typing.get_args(base))
        base = type(choices[0])
    return (
        base,
        (tuple(choices) if choices else None),
        optional,
        bool(field.metadata.get("list_like")),
        field.metadata.get("aliases", {}),
    )


def _convert(
    name: str,
    raw: Any,
    base: Any,
    choices: tuple | None,
    optional: bool,
    list_like: bool = False,
    aliases: dict | None = None,
) -> Any:
    """Coerce one value (a CLI string or a YAML scalar) to the field's type, or raise ConfigError."""
    if raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null") and optional):
        if optional:
            return None
        raise ConfigError(f"--{flag_name(name)} must not be empty")
    if isinstance(raw, (list, tuple, dict)):  # from YAML
        if list_like and isinstance(raw, (list, tuple)) and all(isinstance(item, (str, int, float)) for item in raw):
            raw = ",".join(str(item) for item in raw)
        else:
            kind = {bool: "true or false", int: "integer", float: "number"}.get(base, "string")
            raise ConfigError(
                f"--{flag_name(name)} {shorten(raw)} is invalid: must be one {kind}, not a {type(raw).__name__}"
            )
    try:
        if base is bool:
            if isinstance(raw, bool):
                value = raw
            elif str(raw).lower() in ("1", "true", "yes", "on"):
                value = True
            elif str(raw).lower() in ("0", "false", "no", "off"):
                value = False
            else:
                raise ValueError
        elif base is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError
            value = int(raw) if not isinstance(raw, str) else int(raw, 10)
        elif base is float:
            if isinstance(raw, bool):
                raise ValueError
            value = float(raw)
            if not math.isfinite(value):
                raise ValueError
        else:
            value = str(raw)
    except (TypeError, ValueError):
        kind = {bool: "true or false", int: "an integer", float: "a finite number"}.get(base, "a string")
        raise ConfigError(f"--{flag_name(name)} {shorten(raw)} is invalid: must be {kind}") from None
    value = (aliases or {}).get(value, value)
    if choices is not None and value not in choices:
        allowed = ", ".join(str(c) for c in choices)
        raise ConfigError(f"--{flag_name(name)} {shorten(value)} is invalid: choose one of {allowed}")
    return value


class _OneLineParser(argparse.ArgumentParser):
    """argparse that reports bad flags as one line (exit 2), like every other config error."""

    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(message)


def _help_with_default(field: dataclasses.Field) -> str:
    """The field's help, ending with its default unless the help states it already (a help saying what
    an unset value means beats "None"); an unset default reads "unset", a boolean "on" or "off"."""
    text = field.metadata.get("help", "")
    if "default:" in text:
        return text
    default = field.default_factory() if field.default is dataclasses.MISSING else field.default
    if default is None:
        shown = "unset"
    elif isinstance(default, bool):
        shown = "on" if default else "off"
    else:
        shown = str(default).replace("%", "%%")  # argparse %-formats help texts
    return f"{text} (default: {shown})"


def build_parser(
    cls: type[TrainConfig], description: str | None = None, prog: str | None = None
) -> argparse.ArgumentParser:
    check_option_groups(cls)  # --help too: a clashing group would document the wrong flag
    parser = _OneLineParser(
        prog=prog,
        description=description,
        argument_default=argparse.SUPPRESS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # --max-step is a typo, not --max-steps
    )
    for field in dataclasses.fields(cls):
        base, choices, *_ = _field_kind(cls, field)
        flag = f"--{flag_name(field.name)}"
        help_text = _help_with_default(field)
        if field.metadata.get("positional"):  # a command's operand (acceltrain predict RUN_FOLDER FILE)
            parser.add_argument(field.name, metavar=field.name.upper(), help=field.metadata.get("help", ""))
        elif base is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            metavar = "{" + ",".join(map(str, choices)) + "}" if choices else base.__name__.upper()
            parser.add_argument(flag, metavar=metavar, help=help_text)
    return parser


def _with_suggestion(token: str, known: list[str], quote: bool = False) -> str:
    """``token``, followed by the closest known name when there is one (a typo's likely meaning)."""
    shown = shorten(token) if quote else token
    if not quote and not token.startswith("--"):
        return shown
    close = difflib.get_close_matches(token, known, n=1)
    return (
        f"{shown} (did you mean {close[0]!r}?)"
        if close and quote
        else f"{shown} (did you mean {close[0]}?)"
        if close
        else shown
    )


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, but a key given twice is an error instead of the last one silently winning."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {shorten(key)}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


MAX_PRESET_VALUES = 10_000  # a preset is a flat mapping of option: value, with a few short lists


def _fits(data: Any, limit: int) -> bool:
    """Whether ``data`` holds at most ``limit`` values, each alias counted at every place it is used. YAML aliases
    share one object per anchor, so a 400-byte file loads small but its repr (or a full walk) is exponential:
    this walk stops at the limit, and ends on a list that holds itself."""
    pending, counted = [data], 1
    while pending:
        item = pending.pop()
        children = (
            [*item.keys(), *item.values()]
            if isinstance(item, dict)
            else item
            if isinstance(item, (list, tuple))
            else ()
        )
        counted += len(children)
        if counted > limit:
            return False
        pending.extend(children)
    return True


def load_yaml_preset(path: str) -> dict[str, Any]:
    """``--config``: a YAML file, or the name of a preset shipped with the package (``cifar10_fast``,
    ``cifar10_fast.yaml``), so that presets need no checkout."""
    if not Path(path).exists() and Path(path).name == path:  # a bare name: a preset shipped with the package
        shipped = PRESETS / f"{path.removesuffix('.yaml')}.yaml"
        if not shipped.is_file():
            names = ", ".join(sorted(p.stem for p in PRESETS.glob("*.yaml")))
            raise ConfigError(
                f"--config {shorten(path)} is neither a file nor a shipped preset: give a YAML file or one of {names}"
            )
        path = str(shipped)
    text = read_small_file(path, "--config")
    shown = f"--config {shorten(path, 200)}"
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as err:
        first = " ".join(line.strip() for line in str(err).splitlines()[:2] if line.strip())
        raise ConfigError(f"{shown} is not valid YAML: {first[:300]}") from None
    except RecursionError:  # PyYAML composes nested lists recursively
        raise ConfigError(f"{shown} is nested too deeply: a preset is a mapping of option: value") from None
    if not _fits(data, MAX_PRESET_VALUES):
        raise ConfigError(
            f"{shown} holds more than {MAX_PRESET_VALUES:,} keys and values (an alias counts each time it is "
            "used): a preset is a mapping of option: value"
        )
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{shown} must be a mapping of option: value, got {type(data).__name__}")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


SHOWN_KEYS = 10  # unknown preset keys named in the one line


def parse_config(
    cls: type[TrainConfig], argv: list[str] | None = None, description: str | None = None, prog: str | None = None
):
    """Build a validated ``cls`` from defaults, an optional YAML preset and the command line (``prog``: the command's
    name in ``--help``, default the script's)."""
    parser = build_parser(cls, description, prog)
    parsed, unknown = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if unknown:
        flags = [f"--{flag_name(f.name)}" for f in dataclasses.fields(cls)]
        raise ConfigError("unrecognized arguments: " + " ".join(_with_suggestion(token, flags) for token in unknown))
    given = vars(parsed)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    preset_path = given.get("config")
    if preset_path is not None:
        preset = load_yaml_preset(preset_path)
        unknown_keys = [key for key in preset if key not in fields or key == "config"]
        if unknown_keys:
            shown = ", ".join(
                _with_suggestion(key, [f for f in fields if f != "config"], quote=True)
                for key in unknown_keys[:SHOWN_KEYS]
            )
            more = f" and {len(unknown_keys) - SHOWN_KEYS} more" if len(unknown_keys) > SHOWN_KEYS else ""
            raise ConfigError(
                f"--config {shorten(preset_path, 200)}: unknown key{'s' if len(unknown_keys) > 1 else ''} {shown}{more}"
            )
        for key, raw in preset.items():
            values[key] = _convert(key, raw, *_field_kind(cls, fields[key]))
    for key, raw in given.items():
        values[key] = raw if key == "config" else _convert(key, raw, *_field_kind(cls, fields[key]))
    cfg = cls(**values)
    cfg.validate()
    return cfg
