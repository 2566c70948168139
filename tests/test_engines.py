"""The engine registry without a launch: which engine a launch asks for, which one an accelerator is, what each
refuses before the process group, and what its checkpoints are (each engine's own module, acceltrain/engines/)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from accelerate.utils import DistributedType

from acceltrain import ConfigError, TrainConfig
from acceltrain.engines import (
    CHECKPOINT_FORMATS,
    DDP,
    ENGINES,
    FSDP2,
    DeepSpeed,
    OneProcess,
    engine_of,
    launch_engine,
    requested,
    use_cpu,
)


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    for variable in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_CPU", "WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)


@pytest.mark.parametrize(
    "distributed_type,engine",
    [
        (DistributedType.NO, OneProcess),
        (DistributedType.MULTI_CPU, DDP),
        (DistributedType.MULTI_GPU, DDP),
        (DistributedType.FSDP, FSDP2),
        (DistributedType.DEEPSPEED, DeepSpeed),
    ],
)
def test_each_accelerator_is_one_engine(distributed_type, engine):
    assert type(engine_of(SimpleNamespace(distributed_type=distributed_type))) is engine


def test_what_the_launch_asks_for_is_known_before_the_process_group(monkeypatch):
    assert requested() is None and launch_engine() is OneProcess
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert launch_engine() is DDP
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert requested() is launch_engine() is FSDP2
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert requested() is DeepSpeed and use_cpu(False) is False, "DeepSpeed picks its own CPU accelerator"


def test_an_engine_accelerate_did_not_set_up_is_one_line(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ConfigError, match="asks for FSDP but Accelerate set up MULTI_CPU here"):
        engine_of(SimpleNamespace(distributed_type=DistributedType.MULTI_CPU))


@pytest.mark.parametrize(
    "engine,settings,line",
    [
        (
            DeepSpeed,
            {"optimizer": "muon"},
            "--optimizer muon needs every weight matrix whole on each process, and DeepSpeed flattens",
        ),
        (FSDP2, {"optimizer": "muon"}, "and FSDP flattens or shards them"),
        (DeepSpeed, {"async_checkpoint": True}, "--async-checkpoint works under DDP and FSDP"),
    ],
)
def test_what_an_engine_cannot_run_is_refused_from_the_settings(engine, settings, line):
    with pytest.raises(ConfigError, match=line):
        engine.refuse(TrainConfig(**settings))
    for other in (OneProcess, DDP):
        other.refuse(TrainConfig(**settings))


def test_a_task_summing_its_losses_is_refused_under_deepspeed_only():
    task = SimpleNamespace(sums_losses=True)
    with pytest.raises(ConfigError, match="needs the gradients in param.grad"):
        DeepSpeed.refuse(TrainConfig(), task)
    for engine in (OneProcess, DDP, FSDP2):
        engine.refuse(TrainConfig(), task)


def test_checkpoint_formats_and_what_each_engine_can_continue_on():
    assert CHECKPOINT_FORMATS == ("DDP", "FSDP", "DeepSpeed")
    assert {engine.checkpoint_format for engine in ENGINES} == set(CHECKPOINT_FORMATS)
    assert OneProcess.checkpoint_format == DDP.checkpoint_format, "one process and DDP continue each other's runs"
    assert DeepSpeed(None).relayout_refusal(2, 1).startswith("holds DeepSpeed ZeRO state partitioned over 2")
    assert all(engine(None).relayout_refusal(2, 1) is None for engine in (OneProcess, DDP, FSDP2))
    assert DeepSpeed(None).relayout_refusal(2, 2) is None
