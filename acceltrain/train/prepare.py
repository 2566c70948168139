"""The prepare step of ``fit()``: everything between a recipe's model, optimizer and data and the first
optimizer step. The accelerator for the launch's engine, the speed flags in the order they must happen, the
loaders, ``Accelerator.prepare``, the plan in optimizer steps, the LR schedule, and the one resolved config that
the loop and every hook read from then on (nothing rebinds it later)."""

from __future__ import annotations

import dataclasses
import math
import platform
from pathlib import Path

import accelerate
import torch
from torch import nn
from torch.utils.data import default_collate

from acceltrain import __version__
from acceltrain.config.options import ConfigError
from acceltrain.config.train_config import TrainConfig
from acceltrain.data.eval_subset import eval_subset
from acceltrain.data.loaders import default_num_workers, eval_loader, train_loader
from acceltrain.data.streams import first_samples, is_stream, stream_loader
from acceltrain.engines import Engine, launch_engine
from acceltrain.engines.base import parameters_held
from acceltrain.runtime.distributed import convert_sync_batchnorm
from acceltrain.train.optim import ScheduleProgress, build_scheduler
from acceltrain.train.speed import (
    apply_batch_size,
    device_peaks,
    enable_activation_checkpointing,
    find_batch_size,
    training_flops_per_sample,
)
from acceltrain.train.tasks import check_first_batch


@dataclasses.dataclass
class Prepared:
    """What the loop trains with: each piece once, prepared for the launch's engine."""

    cfg: TrainConfig  # resolved: output folder, loader options, precision, a found batch size, the target metric
    accelerator: accelerate.Accelerator
    engine: Engine
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    schedule_progress: ScheduleProgress
    train_batches: object
    eval_batches: object | None
    total_steps: int
    batches_per_epoch: int  # per process; 0: a stream, whose passes end when the stream does
    train_samples: int
    data_fingerprint: str | None
    flops_per_sample: float | None
    peak_flops: float | None
    runtime: dict
    notes: list[str]  # for the start-up log


def prepare(
    cfg: TrainConfig,
    output_dir: Path,
    model: nn.Module,
    optimizer,
    train_set,
    eval_set,
    task,
    collate_fn,
    trackers: list[str],
) -> Prepared:
    """Build the accelerator, apply the speed flags, make the loaders and ``Accelerator.prepare`` them; plan the run."""
    from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, ProjectConfiguration

    stream = is_stream(train_set)
    engine = launch_engine().start(
        cfg,
        # a stream's windows run across its passes' ends, and its loader's position is checkpointed (streams.py)
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=cfg.grad_accum, sync_with_dataloader=not stream
        ),
        dataloader_config=DataLoaderConfiguration(
            use_stateful_dataloader=stream, dispatch_batches=False if stream else None
        ),
        log_with=trackers or None,
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / "logs")),
    )
    accelerator = engine.accelerator
    collate_fn = collate_fn or default_collate
    model, flops_per_sample, found, notes = _apply_speed_flags(
        cfg, accelerator, model, optimizer, train_set, task, collate_fn
    )
    cfg = _resolved(cfg, accelerator, output_dir, task, found)
    if stream:
        engine.refuse_setting("streams")
    train_loaders, eval_set = _loaders(cfg, engine, train_set, eval_set, collate_fn)
    notes += engine.before_prepare(model, optimizer)
    model, optimizer, *loaders = accelerator.prepare(model, optimizer, *train_loaders)
    notes += engine.after_prepare(model)
    if cfg.data_on_device:
        loaders.insert(
            0,
            train_set.device_loader(
                batch_size=cfg.batch_size,
                seed=cfg.seed,
                device=accelerator.device,
                process_index=accelerator.process_index,
                num_processes=accelerator.num_processes,
                channels_last=cfg.channels_last,
            ),
        )
    batches_per_epoch = 0 if stream else len(loaders[0])
    if batches_per_epoch == 0 and not stream:
        raise ConfigError(
            f"--batch-size {cfg.batch_size} is too large: the {len(train_set)} training samples do not fill one "
            f"batch of {cfg.batch_size} on each of {accelerator.num_processes} processes"
        )
    steps_per_epoch = None if stream else math.ceil(batches_per_epoch / cfg.grad_accum)
    total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))  # a stream has max_steps
    # Not prepared: Accelerate would step it once per process (#1382) and, under DeepSpeed, leave it out
    # of checkpoints; the checkpointer keeps its state. It drives the torch optimizer's param groups.
    schedule_progress = ScheduleProgress()
    scheduler = build_scheduler(optimizer, cfg, total_steps, schedule_progress)
    peaks = device_peaks(accelerator, model, cfg.peak_tflops)
    runtime = _runtime(
        cfg,
        engine,
        model=type(accelerator.unwrap_model(model)).__name__,
        train_rows=None if stream else len(train_set),
        eval_rows=_rows(eval_set),
        classes=_class_count(task, train_set),
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        model_flops_per_sample=flops_per_sample,
        peak_flops_per_device=peaks["used"],
        peak_flops_measured=peaks["measured"],
        peak_flops_shape=peaks["shape"],
        peak_flops_datasheet=peaks["datasheet"],
        **parameters_held(model),
    )
    return Prepared(
        cfg,
        accelerator,
        engine,
        model,
        optimizer,
        scheduler,
        schedule_progress,
        loaders[0],
        loaders[1] if eval_set is not None else None,
        total_steps,
        batches_per_epoch,
        0 if stream else len(train_set),
        _data_fingerprint(train_set),
        flops_per_sample,
        peaks["used"],
        runtime,
        notes,
    )


def _resolved(cfg: TrainConfig, accelerator, output_dir: Path, task, found: dict) -> TrainConfig:
    """The config as this launch runs it, resolved once: the output folder, the loader options, the precision,
    a batch size found by ``--auto-batch-size`` (``found``), ``--target-accuracy`` as ``--target-metric``."""
    resolved = {
        "output_dir": str(output_dir),
        "num_workers": default_num_workers() if cfg.num_workers is None else cfg.num_workers,
        "pin_memory": accelerator.device.type == "cuda" if cfg.pin_memory is None else cfg.pin_memory,
        "mixed_precision": accelerator.mixed_precision,
        **found,
    }
    if cfg.target_accuracy is not None:
        primary = getattr(task, "primary_metric", None)
        if primary != "accuracy":
            raise ConfigError(
                f"--target-accuracy {cfg.target_accuracy} needs a task whose primary metric is accuracy; "
                f"{type(task).__name__}'s is {primary!r}: use --target-metric"
            )
        resolved.update(target_metric=cfg.target_accuracy, target_accuracy=None)
    return dataclasses.replace(cfg, **resolved)


def _data_fingerprint(train_set) -> str | None:
    """The training set's ``fingerprint`` attribute, if it has one: a string that changes with its content, recorded
    in each checkpoint so that a resume refuses other data (a stream has no length to compare)."""
    fingerprint = getattr(train_set, "fingerprint", None)
    if fingerprint is not None and not isinstance(fingerprint, str):
        raise ConfigError(
            f"the training set's fingerprint is a {type(fingerprint).__name__}: it must be a string (or absent)"
        )
    return fingerprint


def _apply_speed_flags(cfg: TrainConfig, accelerator, model: nn.Module, optimizer, train_set, task, collate_fn):
    """The speed flags in the order they must happen: FLOPs are counted on the model as given (activation
    checkpointing would add its recomputed forward); memory format and activation checkpointing change the
    module; the batch-size probe needs the final module on the device; compilation happens before the DDP
    wrap. Returns the model, its training FLOPs per sample, the fields a found batch size changes, and notes."""
    notes, found = [], {}
    sample_batch = collate_fn(first_samples(train_set, 2))
    check_first_batch(task, sample_batch, collate_fn)
    flops_per_sample = getattr(task, "flops_per_sample", None)
    if flops_per_sample is None:
        flops_per_sample = training_flops_per_sample(model, task, sample_batch)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if cfg.activation_checkpointing:
        notes.append(f"activation checkpointing: {enable_activation_checkpointing(model)}")
    if cfg.sync_bn and accelerator.num_processes > 1:
        model = convert_sync_batchnorm(model, on_cpu=accelerator.device.type == "cpu")
    if cfg.auto_batch_size:
        batch_size = find_batch_size(
            accelerator, model, optimizer, task, train_set, start=cfg.batch_size, collate_fn=collate_fn
        )
        found, note = apply_batch_size(cfg, batch_size, optimizer)
        accelerator.gradient_accumulation_steps = found.get("grad_accum", cfg.grad_accum)
        notes.append(note)
    if cfg.compile:
        model.compile(mode=cfg.compile_mode)  # in place: no OptimizedModule wrapper, no `_orig_mod.` keys
    return model, flops_per_sample, found, notes


def _loaders(cfg: TrainConfig, engine: Engine, train_set, eval_set, collate_fn):
    """The loaders for ``Accelerator.prepare`` (none for training with ``--data-on-device``: the dataset's own
    loader comes after), and the eval set as evaluated."""
    options = {
        "num_workers": cfg.num_workers,
        "pin_memory": cfg.pin_memory,
        "prefetch_factor": cfg.prefetch_factor,
        "collate_fn": collate_fn,
    }
    if cfg.data_on_device:
        if not hasattr(train_set, "device_loader"):
            raise ConfigError(
                "--data-on-device needs a dataset with a device_loader() method (acceltrain.vision.ImageClassification "
                f"has one); {type(train_set).__name__} has none"
            )
        eval_set = eval_set.decoded() if hasattr(eval_set, "decoded") else eval_set  # decode eval files once too
    if is_stream(train_set):
        loaders = [stream_loader(train_set, batch_size=cfg.batch_size, **options)]
    else:
        loaders = (
            []
            if cfg.data_on_device
            else [
                train_loader(train_set, batch_size=cfg.batch_size, seed=cfg.seed, shard=engine.data_shard(), **options)
            ]
        )
    if cfg.eval_samples is not None:
        if eval_set is None:
            raise ConfigError(
                f"--eval-samples {cfg.eval_samples} needs an eval set, and this recipe passes none to fit()"
            )
        eval_set = eval_subset(eval_set, cfg.eval_samples, cfg.seed)
    if eval_set is not None:
        loaders.append(eval_loader(eval_set, batch_size=cfg.batch_size, **options))
    return loaders, eval_set


def _runtime(cfg: TrainConfig, engine: Engine, **plan) -> dict:
    """What this launch runs on, for the start-up print, the run config and the summary."""
    accelerator = engine.accelerator
    device = accelerator.device
    return {
        "acceltrain": __version__,
        "torch": str(torch.__version__),
        "accelerate": accelerate.__version__,
        "distributed_type": accelerator.distributed_type.value,
        "engine": engine.name,
        "num_processes": accelerator.num_processes,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "global_batch_size": cfg.batch_size * accelerator.num_processes * cfg.grad_accum,
        **plan,
        **engine.settings(),
    }


def _rows(dataset) -> int | None:
    """A dataset's row count, None for a stream (no length)."""
    try:
        return None if dataset is None or is_stream(dataset) else len(dataset)
    except TypeError:
        return None


def _class_count(task, train_set) -> int | None:
    """How many classes the task or the data names (its ``labels`` or ``classes``), None where neither says."""
    names = getattr(task, "labels", None) or getattr(train_set, "classes", None)
    return len(names) if isinstance(names, (list, tuple)) else None
