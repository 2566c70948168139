"""Learning-rate schedules: transformers' shapes, a warm-up whose first step already trains."""

from __future__ import annotations

import typing

import pytest
import torch
from transformers import get_scheduler

from acceltrain import TrainConfig
from acceltrain.config.train_config import LRSchedule
from acceltrain.train.optim import DECAYS, build_scheduler, lr_multiplier

TRANSFORMERS_NAME = {"constant": "constant_with_warmup", "cosine": "cosine", "linear": "linear"}


def test_every_schedule_the_config_allows_has_a_decay():
    assert set(DECAYS) == set(typing.get_args(LRSchedule))


@pytest.mark.parametrize("schedule", sorted(DECAYS))
@pytest.mark.parametrize("warmup", [0, 1, 3])
def test_schedules_are_transformers_ones_one_step_later_with_one_more_warmup_step(schedule, warmup):
    total = 12
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    reference = get_scheduler(
        TRANSFORMERS_NAME[schedule], optimizer, num_warmup_steps=warmup + 1, num_training_steps=total + 1
    )
    expected = [reference.lr_lambdas[0](step + 1) for step in range(total)]
    ours = [lr_multiplier(step, total_steps=total, warmup_steps=warmup, schedule=schedule) for step in range(total)]
    assert ours == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("schedule", sorted(DECAYS))
def test_no_step_is_taken_at_lr_zero_unlike_transformers_warmup(schedule):
    """transformers' warm-up gives its first optimizer step lr 0: a step that changes nothing."""
    total, warmup = 10, 4
    multipliers = [
        lr_multiplier(step, total_steps=total, warmup_steps=warmup, schedule=schedule) for step in range(total)
    ]
    assert multipliers[0] == pytest.approx(1 / 5) and min(multipliers) > 0
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    assert get_scheduler(
        TRANSFORMERS_NAME[schedule], optimizer, num_warmup_steps=warmup, num_training_steps=total
    ).get_last_lr() == [0.0]


def test_the_scheduler_steps_through_the_multipliers_once_per_step():
    cfg = TrainConfig(lr=0.5, warmup_steps=2, lr_schedule="linear")
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.lr)
    scheduler = build_scheduler(optimizer, cfg, total_steps=6)
    seen = []
    for _ in range(6):
        seen.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx(
        [0.5 * lr_multiplier(s, total_steps=6, warmup_steps=2, schedule="linear") for s in range(6)]
    )
    assert seen == pytest.approx([0.5 / 3, 1.0 / 3, 0.5, 0.375, 0.25, 0.125])


def test_the_decays_take_a_progress_fraction_for_budgets_other_than_steps():
    assert [DECAYS[name](0.5) for name in ("constant", "cosine", "linear")] == pytest.approx([1.0, 0.5, 0.5])
    assert [DECAYS[name](1.0) for name in ("cosine", "linear")] == pytest.approx([0.0, 0.0])


def test_normalisation_parameters_can_take_a_scaled_lr_that_follows_the_schedule_other_biases_do_not():
    """airbench94's 64x is for BatchNorm biases only: a conv's bias (its whitening layer's) keeps the base lr."""
    from torch import nn

    from acceltrain.config.train_config import TrainConfig
    from acceltrain.train.optim import build_optimizer, build_scheduler

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    cfg = TrainConfig(lr=0.1, norm_bias_lr_scale=64.0, warmup_steps=0, lr_schedule="linear")
    optimizer = build_optimizer(model, cfg)
    groups = [(len(group["params"]), group["lr"], group["weight_decay"]) for group in optimizer.param_groups]
    assert groups == [(1, 0.1, cfg.weight_decay), (1, 0.1, 0.0), (2, 0.1 * 64, 0.0)]  # conv weight; conv bias; BN
    scheduler = build_scheduler(optimizer, cfg, total_steps=4)
    optimizer.step()
    scheduler.step()
    assert [group["lr"] for group in optimizer.param_groups] == pytest.approx([0.075, 0.075, 0.075 * 64])


def test_decay_all_parameters_decays_every_group_by_the_same_fraction_per_step():
    """airbench94: weight decay per step is lr x weight_decay; with the BatchNorm group's 64x lr its weight
    decay is 1/64, so biases and norms shrink as fast as the weights."""
    from torch import nn

    from acceltrain.train.optim import build_optimizer

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    cfg = TrainConfig(lr=0.1, weight_decay=0.01, norm_bias_lr_scale=64.0, decay_all_parameters=True)
    per_step = [group["lr"] * group["weight_decay"] for group in build_optimizer(model, cfg).param_groups]
    assert per_step == pytest.approx([0.1 * 0.01] * 3)


def test_the_warm_up_can_start_and_the_decay_end_above_zero():
    """airbench94's triangle: from 0.2 of the peak lr up to it, then down to 0.07."""
    lr = [
        lr_multiplier(step, total_steps=100, warmup_steps=20, schedule="linear", warmup_start=0.2, floor=0.07)
        for step in range(101)
    ]
    assert lr[0] == pytest.approx(0.2 + 0.8 / 21) and max(lr) == pytest.approx(1.0)
    assert lr[60] == pytest.approx(0.07 + 0.93 * 0.5) and lr[100] == pytest.approx(0.07)
    assert lr_multiplier(100, total_steps=100, warmup_steps=20, schedule="cosine", floor=0.07) == pytest.approx(0.07)


def test_adamw_is_torchs_fused_kernel_and_steps_as_the_default_one():
    """The one-kernel AdamW (Transformers' Trainer's default too): the same updates as torch's default AdamW
    on the same groups within float rounding, and a checkpoint's optimizer state loads back fused."""
    from acceltrain import build_optimizer

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))

    cfg = TrainConfig(optimizer="adamw", lr=0.01, weight_decay=0.1)
    fused_model, default_model = model(), model()
    fused = build_optimizer(fused_model, cfg)
    assert all(group["fused"] for group in fused.param_groups)
    same = dict(zip((id(p) for p in fused_model.parameters()), default_model.parameters(), strict=True))
    default = torch.optim.AdamW(
        [
            {
                **{k: v for k, v in group.items() if k not in ("params", "fused")},
                "params": [same[id(p)] for p in group["params"]],
            }
            for group in fused.param_groups
        ]
    )
    inputs = torch.randn(16, 4)
    for _ in range(5):
        for net, optimizer in ((fused_model, fused), (default_model, default)):
            optimizer.zero_grad()
            net(inputs).square().mean().backward()
            optimizer.step()
    for ours, theirs in zip(fused_model.parameters(), default_model.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    again = build_optimizer(fused_model, cfg)
    again.load_state_dict(fused.state_dict())
    assert all(group["fused"] for group in again.param_groups)
    older = build_optimizer(default_model, cfg)  # a checkpoint written before AdamW was fused: resumes as it ran
    older.load_state_dict(default.state_dict())
    assert not any(group["fused"] for group in older.param_groups)
    default_model(inputs).square().mean().backward()
    older.step()


def test_adamw_under_fp16_is_one_whose_overflowed_steps_the_grad_scaler_skips():
    """A fused AdamW skips an overflowed fp16 step inside its kernel, so the grad scaler calls its step()
    anyway and Accelerate reports no skipped step (accelerate#4242): the schedule would move on. Under fp16
    the AdamW is torch's default one, whose step() the grad scaler does not call on an overflow."""
    from acceltrain import build_optimizer

    model = torch.nn.Linear(4, 2)
    fp16 = build_optimizer(model, TrainConfig(optimizer="adamw", mixed_precision="fp16"))
    assert not getattr(fp16, "_step_supports_amp_scaling", False)
    assert getattr(
        build_optimizer(model, TrainConfig(optimizer="adamw", mixed_precision="bf16")),
        "_step_supports_amp_scaling",
        False,
    )
