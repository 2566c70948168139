"""Optimizer and learning-rate schedule, both defined in optimizer steps of this run."""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn

from .config import TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """SGD (Nesterov) or AdamW at ``cfg.lr``. Weight decay applies to weight matrices and conv kernels
    only, not to biases and normalisation scales (decaying those only hurts)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0)
    return torch.optim.AdamW(groups, lr=cfg.lr)


def lr_multiplier(step: int, *, total_steps: int, warmup_steps: int, schedule: str) -> float:
    """Fraction of the peak lr for the optimizer step numbered ``step`` (0-based): linear warm-up from
    1/(warmup+1), then constant, cosine to 0, or linear to 0 (onecycle) at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - progress


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int):
    """A LambdaLR stepped exactly once per optimizer step by the loop (never by Accelerate, whose
    prepared scheduler otherwise steps once per process: accelerate#1382, #2318)."""
    multiplier = partial(lr_multiplier, total_steps=total_steps, warmup_steps=cfg.warmup_steps, schedule=cfg.lr_schedule)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
