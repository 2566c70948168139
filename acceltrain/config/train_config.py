"""The typed training config: the single source of truth for CLI flags, YAML presets and trackers.

A recipe subclasses :class:`TrainConfig` to add its own fields (model, dataset, ...). Every field
becomes a kebab-case flag (``batch_size`` -> ``--batch-size``) whose help text is the field's
``help`` metadata. Precedence: dataclass default < ``--config`` YAML preset < explicit CLI flag.
Validation runs before anything heavy (no process group, no output folder, no data).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from acceltrain.config.groups import (
    CheckpointOptions,
    EarlyStoppingOptions,
    EvaluationOptions,
    HubOptions,
    LoggingOptions,
    PlotOptions,
    ProfilingOptions,
    TimeBudgetOptions,
    TrackingOptions,
)
from acceltrain.config.options import ConfigError, Options, option, require

__all__ = [
    "CompileMode",
    "LRSchedule",
    "LogLevel",
    "LoopOptions",
    "MixedPrecision",
    "Optimizer",
    "ScaleLR",
    "TrainConfig",
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
    resuming and outputs. Each built-in hook's settings are its own group (:mod:`acceltrain.config.groups`)."""

    config: str | None = option(None, "YAML preset to load; explicit flags override its values", free_on_resume=True)
    # -- length and batch
    batch_size: int = option(128, "micro-batch size per process (an epoch's last incomplete batch is dropped)")
    grad_accum: int = option(1, "micro-batches accumulated per optimizer step")
    epochs: float = option(1.0, "epochs to train when --max-steps is not given")
    max_steps: int | None = option(None, "optimizer steps to train; overrides --epochs")
    # -- optimizer and schedule
    optimizer: Optimizer = option(
        "sgd",
        "sgd (Nesterov momentum), adamw (torch's fused kernel), or muon: torch.optim.Muon on the hidden weight "
        "matrices and conv kernels, SGD on embeddings, the head, biases and normalisation (airbench94_muon)",
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
        None,
        "peak TFLOP/s of one device that MFU is a fraction of (default: measured at start on the model's largest "
        "layer, cached per machine)",
        free_on_resume=True,
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
        "start a new run in an --output-dir that holds an earlier one; that one is moved aside to "
        "<dir>.overwritten-<time>",
        free_on_resume=True,
    )
    allow_config_change: bool = option(
        False,
        "with --resume: apply settings that differ from the checkpoint's (recorded as config_changes) instead of "
        "refusing",
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
