"""The speed toolkit behind flags: channels_last, activation checkpointing, torch.compile, the automatic
batch size, and the FLOP count and peak FLOP/s behind MFU (the datasheet table, and the measured peak)."""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from collections.abc import Mapping

import torch
from torch import nn

from acceltrain.config.options import ConfigError
from acceltrain.config.train_config import TrainConfig
from acceltrain.runtime.peak import DEFAULT_SIDE, MIN_SIDE, ROWS

# Dense peak TFLOP/s of one device from the vendors' datasheets (no sparsity). "tf32" applies to fp32
# runs where cuDNN/cuBLAS may use TF32 tensor cores (PyTorch's default for convolutions).
PEAK_TFLOPS = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
    "H100 SXM": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "RTX 4090": {"bf16": 165.0, "fp16": 165.0, "tf32": 82.6, "fp32": 82.6},
    "RTX 3090": {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6},
    "V100": {"fp16": 125.0, "fp32": 15.7},
    "T4": {"fp16": 65.0, "fp32": 8.1},
}


def device_peaks(accelerator, model: nn.Module, override_tflops: float | None) -> dict[str, float | None]:
    """The peak FLOP/s of one training device for the run's precision: ``datasheet`` (the table, or None),
    ``measured`` (:mod:`acceltrain.runtime.peak`: calibrated on the main process while the others wait, or cached) and
    ``used`` for MFU: ``--peak-tflops`` when given, else the measured one; and ``shape``, the matmul measured."""
    from accelerate.utils import broadcast_object_list

    from acceltrain.runtime.peak import measured_peak_flops

    measured = [None, None]
    if accelerator.is_main_process:
        shape = matmul_shape(accelerator.unwrap_model(model))
        measured = [measured_peak_flops(accelerator.device, accelerator.mixed_precision, shape), list(shape)]
    if accelerator.num_processes > 1:
        broadcast_object_list(measured, from_process=0)
    used = override_tflops * 1e12 if override_tflops is not None else measured[0]
    datasheet = datasheet_peak_flops(accelerator.device, accelerator.mixed_precision)
    return {"datasheet": datasheet, "measured": measured[0], "used": used, "shape": measured[1]}


def matmul_shape(model: nn.Module | None) -> tuple[int, int, int]:
    """(rows, inputs, outputs) of the peak's calibration: 2048 rows by the largest dense layer's inputs and outputs,
    each at least 256 (a linear layer, a convolution as the matrix product it is, GPT-2's ``Conv1D``); a model without
    one, or none, gets a square of 1024."""
    best = (0, DEFAULT_SIDE, DEFAULT_SIDE)
    for module in model.modules() if model is not None else ():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() < 2:
            continue
        if isinstance(module, nn.Linear):
            outputs, inputs = weight.shape
        elif isinstance(module, nn.modules.conv._ConvNd):  # shapes only: indexing a sharded weight (FSDP) communicates
            outputs, inputs = weight.shape[0], math.prod(weight.shape[1:])
        elif type(module).__name__ == "Conv1D":  # transformers' GPT-2 layer: a (inputs, outputs) weight
            inputs, outputs = weight.shape
        else:
            continue
        if inputs * outputs > best[0]:
            best = (inputs * outputs, inputs, outputs)
    return ROWS, max(MIN_SIDE, best[1]), max(MIN_SIDE, best[2])


def datasheet_peak_flops(device: torch.device, mixed_precision: str) -> float | None:
    """Peak FLOP/s of one device for this precision from the vendors' table, or None (a CPU, an unlisted GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    entry = next((peaks for key, peaks in PEAK_TFLOPS.items() if key in name), None)
    if entry is None:
        return None
    if mixed_precision in ("bf16", "fp16"):
        tflops = entry.get(mixed_precision)
    elif torch.backends.cudnn.allow_tf32 or torch.backends.cuda.matmul.allow_tf32:
        tflops = entry.get("tf32", entry["fp32"])
    else:
        tflops = entry["fp32"]
    return tflops * 1e12 if tflops else None


def training_flops_per_sample(model: nn.Module, task, batch) -> float | None:
    """Forward + backward FLOPs of one sample, counted once by ``torch.utils.flop_counter`` on a copy of
    the model on the meta device (no compute, no side effect on weights or BatchNorm statistics).
    None when some op cannot run on meta tensors."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        meta_model = copy.deepcopy(model).to("meta")
        meta_batch = _map_tensors(batch, lambda t: t.to("meta"))
        with FlopCounterMode(display=False) as counter:
            loss = task.train_loss(meta_model, meta_batch)
            loss = loss[0] if isinstance(loss, tuple) else loss
            loss.backward()
        samples = _batch_len(batch)
        return counter.get_total_flops() / samples if samples else None
    except Exception:  # noqa: BLE001 - an unsupported op only costs the MFU figure
        return None


def to_channels_last(batch):
    """Images (4-d float tensors) of a batch in channels_last memory format; everything else unchanged."""
    return _map_tensors(
        batch,
        lambda t: t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 and t.is_floating_point() else t,
    )


def _map_tensors(batch, fn):
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):  # a dict, or transformers' BatchEncoding (a UserDict) from a collator
        return {key: _map_tensors(value, fn) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map_tensors(value, fn) for value in batch)
    return batch


def _batch_len(batch) -> int:
    if isinstance(batch, torch.Tensor):
        return len(batch)
    values = batch.values() if isinstance(batch, Mapping) else batch
    return next(len(v) for v in values if isinstance(v, torch.Tensor))


# --------------------------------------------------------------------------- activation checkpointing


def enable_activation_checkpointing(model: nn.Module) -> str:
    """Recompute activations in backward instead of storing them (``use_reentrant=False``). Hugging Face
    models use their own ``activation_checkpointing_enable`` (older Transformers releases call it
    ``gradient_checkpointing_enable``); ResNets checkpoint each residual block. Returns what was done, for the log."""
    for hook in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        if hasattr(model, hook):
            keyword = hook.replace("_enable", "_kwargs")
            getattr(model, hook)(**{keyword: {"use_reentrant": False}})
            return f"{hook}(use_reentrant=False)"
    from torchvision.models.resnet import BasicBlock, Bottleneck

    blocks = [module for module in model.modules() if isinstance(module, (BasicBlock, Bottleneck))]
    if not blocks:
        raise ConfigError(
            f"--activation-checkpointing: {type(model).__name__} has no residual blocks and no "
            "activation_checkpointing_enable(); supported: torchvision-style ResNets and Hugging Face models"
        )
    for block in blocks:
        block.forward = functools.partial(_checkpointed_forward, block, block.forward)
    return f"{len(blocks)} residual blocks checkpointed"


def _checkpointed_forward(block: nn.Module, forward, *args, **kwargs):
    from torch.utils.checkpoint import checkpoint

    if not (torch.is_grad_enabled() and block.training):
        return forward(*args, **kwargs)
    recompute = functools.partial(_frozen_batchnorm_statistics, block)
    return checkpoint(
        forward, *args, use_reentrant=False, context_fn=lambda: (contextlib.nullcontext(), recompute()), **kwargs
    )


@contextlib.contextmanager
def _frozen_batchnorm_statistics(block: nn.Module):
    """The recomputation runs the block's BatchNorms a second time in training mode; restore their running
    statistics afterwards so that checkpointing changes memory and time, never the trained model."""
    norms = [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    saved = [(m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone()) for m in norms]
    try:
        yield
    finally:
        for module, (mean, var, count) in zip(norms, saved, strict=True):
            module.running_mean.copy_(mean)
            module.running_var.copy_(var)
            module.num_batches_tracked.copy_(count)


# --------------------------------------------------------------------------- automatic batch size


def find_batch_size(accelerator, model: nn.Module, optimizer, task, dataset, start: int, collate_fn=None) -> int:
    """The largest batch size from ``start`` down (halving) whose forward, backward and optimizer step fit,
    through Accelerate's ``find_executable_batch_size``. Probed on the unwrapped model (no collective can
    hang on one process's out-of-memory), weights and optimizer state restored afterwards; all processes
    then take the smallest."""
    from accelerate.utils import find_executable_batch_size

    weights = copy.deepcopy(model.state_dict())
    optimizer_state = copy.deepcopy(optimizer.state_dict())
    model.to(accelerator.device)
    current = [min(start, len(dataset))]

    def halve() -> int:
        current[0] //= 2
        return current[0]

    @find_executable_batch_size(starting_batch_size=current[0], reduce_batch_size_fn=halve)
    def probe(batch_size: int) -> int:
        samples = [dataset.sample(i, 0) if hasattr(dataset, "sample") else dataset[i] for i in range(batch_size)]
        batch = _map_tensors(
            (collate_fn or torch.utils.data.default_collate)(samples), lambda t: t.to(accelerator.device)
        )
        with accelerator.autocast():
            loss = task.train_loss(model, batch)
        loss = loss[0] if isinstance(loss, tuple) else loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return batch_size

    try:
        found = probe()
    except RuntimeError as err:
        if "No executable batch size found" in str(err):
            raise ConfigError("--auto-batch-size: even a batch of 1 does not fit in memory") from None
        raise
    finally:
        model.load_state_dict(weights)
        optimizer.load_state_dict(optimizer_state)
    agreed = accelerator.gather(torch.tensor([found], device=accelerator.device)).min().item()
    return int(agreed)


def apply_batch_size(cfg: TrainConfig, found: int, optimizer) -> tuple[dict, str]:
    """What ``--auto-batch-size`` changes when it chose ``found``: the accumulation raised to keep the
    effective batch (``--keep-effective-batch``), the lr scaled linearly if the effective batch changed
    and ``--scale-lr linear``. Returns the config fields that change and a sentence saying what was done."""
    if found == cfg.batch_size:
        return {}, f"--auto-batch-size: batch {found} fits; nothing changed"
    grad_accum = math.ceil(cfg.batch_size * cfg.grad_accum / found) if cfg.keep_effective_batch else cfg.grad_accum
    before, after = cfg.batch_size * cfg.grad_accum, found * grad_accum
    lr = cfg.lr
    if after != before and cfg.scale_lr == "linear":
        lr = cfg.lr * after / before
        for group in optimizer.param_groups:
            group["lr"] *= after / before
    message = (
        f"--auto-batch-size: batch {cfg.batch_size} does not fit, using {found} x {grad_accum} accumulation "
        f"(effective batch per process {before} -> {after}; lr {cfg.lr:g} -> {lr:g})"
    )
    return {"batch_size": found, "grad_accum": grad_accum, "lr": lr}, message
