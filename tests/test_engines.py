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


def test_one_process_reads_back_exactly_the_parts_it_writes(tmp_path):
    """Issue 44 item 1, without a launch: the parts the one-process engine gives (a model whose weights are tied, an
    optimizer with state) are written by the writers and read back by the engine into fresh objects, equal."""
    import torch
    from accelerate import Accelerator
    from torch import nn

    from acceltrain.checkpoint.writers import write_part

    def tied_model_and_optimizer(seed: int):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False), nn.BatchNorm1d(8))
        model[1].weight = model[0].weight  # tied: saved once
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(*tied_model_and_optimizer(0))
    model(torch.tensor([1, 2, 3])).sum().backward()
    optimizer.step()
    engine = engine_of(accelerator)
    for part in engine.checkpoint_parts(model, optimizer, frozenset()):
        write_part(part, tmp_path)
    fresh, fresh_optimizer = accelerator.prepare(*tied_model_and_optimizer(1))
    engine.load_parts(tmp_path, fresh, fresh_optimizer)
    assert fresh[1].weight is fresh[0].weight, "the tie is kept"
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    saved, loaded = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert saved["param_groups"] == loaded["param_groups"]
    for key, state in saved["state"].items():
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(loaded["state"][key][name]), torch.as_tensor(value)), (key, name)
