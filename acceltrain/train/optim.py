"""Optimizer and learning-rate schedule, both defined in optimizer steps of this run."""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn

from acceltrain.config.options import ConfigError, require
from acceltrain.config.train_config import TrainConfig

NORMALISATIONS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """SGD (Nesterov) or AdamW (fused: :func:`fused_adamw`) at ``cfg.lr``; or Muon on the hidden matrices
    (:class:`MuonWithSGD`) with SGD on the rest. Weight decay applies to weight matrices and conv kernels only, not to
    biases and normalisation scales (the usual choice), unless ``cfg.decay_all_parameters``: then every parameter decays
    by the same fraction per step (airbench94), so the group with the scaled lr gets the weight decay divided by that
    scale. The normalisation layers' parameters take ``cfg.norm_bias_lr_scale`` times the lr (airbench94 trains its
    BatchNorm biases 64x faster; other biases, such as its whitening conv's, keep the base lr)."""
    norm = {id(p) for m in model.modules() if isinstance(m, NORMALISATIONS) for p in m.parameters(recurse=False)}
    decay, other, scaled = [], [], []
    for param in model.parameters():
        if param.requires_grad:
            (scaled if id(param) in norm else decay if param.ndim >= 2 else other).append(param)
    other_decay = cfg.weight_decay if cfg.decay_all_parameters else 0.0
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": other, "weight_decay": other_decay},
        {"params": scaled, "weight_decay": other_decay / cfg.norm_bias_lr_scale, "lr": cfg.lr * cfg.norm_bias_lr_scale},
    ]
    matrices = []
    if cfg.optimizer == "muon":
        muon = muon_parameters(model)
        matrices = [param for param in decay if id(param) in muon]
        if not matrices:
            raise ConfigError(
                f"--optimizer muon found no hidden weight matrices in {type(model).__name__} (it leaves "
                "embeddings, the last Linear and vectors to SGD): use --optimizer sgd or adamw"
            )
        groups[0]["params"] = [param for param in decay if id(param) not in muon]
    groups = [group for group in groups if group["params"]]  # a model without norms or biases: no empty group
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, fused=fused_adamw(cfg.mixed_precision))
    sgd = torch.optim.SGD(groups or [{"params": []}], lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0)
    if cfg.optimizer == "sgd":
        return sgd
    return MuonWithSGD(matrices, sgd, lr=cfg.muon_lr, momentum=cfg.muon_momentum, weight_decay=cfg.muon_weight_decay)


def fused_adamw(mixed_precision: str) -> bool | None:
    """torch's one-kernel AdamW (Transformers' Trainer's default) where it is safe, else torch's default:
    - not under fp16: a fused optimizer skips an overflowed step inside its kernel, so the grad scaler calls
      ``step()`` every time and Accelerate 1.16 never reports ``optimizer_step_was_skipped``
      (accelerate#4242): the schedule would advance on skipped steps;
    - not where torch_xla is installed: torch has no fused kernel for XLA devices.
    A checkpoint keeps the choice it was saved with (``load_state_dict`` restores ``fused``)."""
    from accelerate.utils import is_torch_xla_available

    return None if mixed_precision == "fp16" or is_torch_xla_available() else True


def muon_parameters(model: nn.Module) -> set[int]:
    """The ids of the parameters Muon updates: the hidden weights of two or more dimensions (conv kernels,
    linear and Transformers ``Conv1D`` matrices), not embeddings and not the last ``nn.Linear`` (the head),
    which Muon's authors leave to the other optimizer."""
    linears = [module for module in model.modules() if isinstance(module, nn.Linear)]
    kept_out = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    kept_out |= {id(p) for p in linears[-1].parameters(recurse=False)} if linears else set()
    return {id(p) for p in model.parameters() if p.requires_grad and p.ndim >= 2 and id(p) not in kept_out}


def _as_matrix(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``tensor`` as the (rows, rest) matrix of ``like``'s memory order: for a parameter, a view sharing its
    memory (contiguous or channels_last alike), so that an update of the matrix updates the kernel."""
    dims = sorted(range(like.ndim), key=lambda dim: (dim != 0, -like.stride(dim)))
    return tensor.detach().permute(dims).reshape(len(like), -1)


class MuonWithSGD(torch.optim.Optimizer):
    """``torch.optim.Muon`` (Nesterov) on the hidden matrices and ``sgd`` on every other parameter, as one
    optimizer: one object for Accelerate to prepare and checkpoint and for the schedule to drive (the
    first param group is Muon's, the others are ``sgd``'s own dicts). airbench94_muon trains its conv
    filters so. torch's Muon takes 2-D parameters only: a kernel is given to it as a matrix view of its
    memory, re-made when the kernel moved (to the device, to channels_last) after the optimizer was built."""

    def __init__(
        self, matrices: list[nn.Parameter], sgd: torch.optim.SGD, *, lr: float, momentum: float, weight_decay: float
    ):
        super().__init__([{"params": matrices}], {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})
        self.sgd = sgd
        self.param_groups += [group for group in sgd.param_groups if group["params"]]
        self.muon = torch.optim.Muon(
            [_as_matrix(p, p) for p in matrices], lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=True
        )

    @torch.no_grad()
    def step(self, closure=None):
        group, inner = self.param_groups[0], self.muon.param_groups[0]
        inner.update({key: group[key] for key in ("lr", "momentum", "weight_decay")})  # the schedule sets group's lr
        for index, param in enumerate(group["params"]):
            view = inner["params"][index]
            if view.data_ptr() != param.data_ptr() or view.device != param.device:
                inner["params"][index] = fresh = _as_matrix(param, param)
                if view in self.muon.state:
                    self.muon.state[fresh] = self.muon.state.pop(view)
                view = fresh
            view.grad = None if param.grad is None else _as_matrix(param.grad, param)
        self.muon.step()
        self.sgd.step()
        for view in inner["params"]:
            view.grad = None

    def state_dict(self) -> dict:
        return {
            "muon": self.muon.state_dict(),
            "sgd": self.sgd.state_dict(),
            "muon_group": {key: value for key, value in self.param_groups[0].items() if key != "params"},
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self.muon.load_state_dict(state_dict["muon"])
        self.sgd.load_state_dict(state_dict["sgd"])  # new group dicts: point ours at them
        self.param_groups[0].update(state_dict["muon_group"])
        self.param_groups[1:] = [group for group in self.sgd.param_groups if group["params"]]


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


def lr_multiplier(
    step: int,
    *,
    total_steps: int,
    warmup_steps: int,
    schedule: str,
    time_fraction: float = 0.0,
    warmup_start: float = 0.0,
    floor: float = 0.0,
) -> float:
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


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int, progress: ScheduleProgress | None = None
):
    """A LambdaLR stepped exactly once per optimizer step by the loop (never by Accelerate, whose
    prepared scheduler otherwise steps once per process: accelerate#1382, #2318); ``progress`` may move
    the decay ahead of the step count (a time budget)."""
    require(cfg.lr_schedule in DECAYS, "lr_schedule", cfg.lr_schedule, f"one of {', '.join(DECAYS)}")
    multiplier = partial(
        lr_multiplier,
        total_steps=total_steps,
        warmup_steps=cfg.warmup_steps,
        schedule=cfg.lr_schedule,
        warmup_start=cfg.warmup_start_rate,
        floor=cfg.min_lr_rate,
    )
    progress = progress or ScheduleProgress()
    return Schedule(optimizer, lambda step: multiplier(step, time_fraction=progress.time_fraction))


class Schedule(torch.optim.lr_scheduler.LambdaLR):
    """The run's LR schedule, which can also take new optimizer settings after a resume (``--allow-config-change``):
    the checkpoint's load puts its own hyperparameters back, then :meth:`apply` gives the optimizer this launch's
    (:meth:`hyperparameters`, taken before the load), and the schedule continues from the new peak at the same step."""

    def hyperparameters(self) -> list[dict]:
        """The optimizer's settings per parameter group (lr, momentum, weight decay, ...), its parameters left out."""
        return [
            {key: value for key, value in group.items() if key != "params"} for group in self.optimizer.param_groups
        ]

    def apply(self, hyperparameters: list[dict]) -> None:
        groups = self.optimizer.param_groups
        for group, fresh in zip(groups, hyperparameters, strict=True):
            group.update(fresh)
        self.base_lrs = [group["initial_lr"] for group in groups]
        values = [
            base * multiplier(self.last_epoch) for base, multiplier in zip(self.base_lrs, self.lr_lambdas, strict=True)
        ]
        for group, value in zip(groups, values, strict=True):
            group["lr"] = value
        self._last_lr = values  # what get_last_lr() returns until the next step
