"""Optimizer and learning-rate schedule, both defined in optimizer steps of this run."""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn

from .config import TrainConfig, require


NORMALISATIONS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """SGD (Nesterov) or AdamW at ``cfg.lr``. Weight decay applies to weight matrices and conv kernels
    only, not to biases and normalisation scales (the usual choice), unless ``cfg.decay_all_parameters``:
    then every parameter decays by the same fraction per step (airbench94), so the group with the scaled
    lr gets the weight decay divided by that scale. The normalisation layers' parameters take
    ``cfg.norm_bias_lr_scale`` times the lr (airbench94 trains its BatchNorm biases 64x faster; other
    biases, such as its whitening conv's, keep the base lr)."""
    norm = {id(p) for m in model.modules() if isinstance(m, NORMALISATIONS) for p in m.parameters(recurse=False)}
    decay, other, scaled = [], [], []
    for param in model.parameters():
        if param.requires_grad:
            (scaled if id(param) in norm else decay if param.ndim >= 2 else other).append(param)
    other_decay = cfg.weight_decay if cfg.decay_all_parameters else 0.0
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": other_decay},
              {"params": scaled, "weight_decay": other_decay / cfg.norm_bias_lr_scale, "lr": cfg.lr * cfg.norm_bias_lr_scale}]
    groups = [group for group in groups if group["params"]]  # a model without norms or biases: no empty group
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0)
    return torch.optim.AdamW(groups, lr=cfg.lr)


# The shape after warm-up, at ``progress`` in [0, 1] of the decay: of its steps, or of any other budget
# (elapsed time) a caller measures progress in. The names are transformers.get_scheduler's.
DECAYS = {
    "constant": lambda progress: 1.0,
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
    "linear": lambda progress: 1.0 - progress,
}


class ScheduleProgress:
    """The run's progress towards an end other than its last step, in [0, 1]: the elapsed fraction of
    ``--time-budget-minutes``, set after each step by the TimeBudget hook. The decay follows whichever
    end is nearer."""

    def __init__(self):
        self.time_fraction = 0.0


def lr_multiplier(step: int, *, total_steps: int, warmup_steps: int, schedule: str, time_fraction: float = 0.0,
                  warmup_start: float = 0.0, floor: float = 0.0) -> float:
    """Fraction of the peak lr for the optimizer step numbered ``step`` (0-based): a linear warm-up from
    1/(warmup+1) (raised to ``warmup_start`` + the rest), then ``DECAYS[schedule]`` reaching its end,
    ``floor``, at ``total_steps`` (or earlier, at ``time_fraction`` 1, when that is ahead of the steps).

    transformers.get_scheduler has these shapes but starts its warm-up at lr 0, so its first step
    changes nothing; this is its schedule one step later with one more warm-up step (tested), so that
    every step, the first included, trains."""
    if step < warmup_steps:
        return warmup_start + (1 - warmup_start) * (step + 1) / (warmup_steps + 1)
    progress = min(1.0, max(time_fraction, (step - warmup_steps) / max(1, total_steps - warmup_steps)))
    return floor + (1 - floor) * DECAYS[schedule](progress)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int, progress: ScheduleProgress | None = None):
    """A LambdaLR stepped exactly once per optimizer step by the loop (never by Accelerate, whose
    prepared scheduler otherwise steps once per process: accelerate#1382, #2318); ``progress`` may move
    the decay ahead of the step count (a time budget)."""
    require(cfg.lr_schedule in DECAYS, "lr_schedule", cfg.lr_schedule, f"one of {', '.join(DECAYS)}")
    multiplier = partial(lr_multiplier, total_steps=total_steps, warmup_steps=cfg.warmup_steps, schedule=cfg.lr_schedule,
                         warmup_start=cfg.warmup_start_rate, floor=cfg.min_lr_rate)
    progress = progress or ScheduleProgress()
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: multiplier(step, time_fraction=progress.time_fraction))
