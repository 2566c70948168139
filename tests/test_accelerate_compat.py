"""Every private part of Accelerate the toolkit relies on (acceltrain/accelerate_compat.py, issue 37),
checked against the installed Accelerate: an upgrade that changes one fails here, naming the use, instead of deep
inside a run. And no module but the compat module touches them."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from conftest import REPO

from acceltrain import accelerate_compat

PRIVATE = re.compile(
    r"accelerator\._[a-z]|_shared_state|accelerate\.checkpointing|DataLoaderStateMixin|\.step = |"
    r"_iterator_finished|dl_state_dict"
)


def test_no_module_but_the_compat_module_touches_accelerates_private_parts():
    found = [
        f"{path.relative_to(REPO)}: {line.strip()}"
        for path in (REPO / "acceltrain").rglob("*.py")
        if path.name != "accelerate_compat.py"
        for line in path.read_text().splitlines()
        if PRIVATE.search(line)
    ]
    assert not found, "\n".join(found)


def test_load_loop_state_reads_back_what_save_loop_state_writes(tmp_path):
    from accelerate import Accelerator
    from accelerate.checkpointing import load_accelerator_state, save_accelerator_state

    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(torch.utils.data.DataLoader(list(range(8)), batch_size=2))
    assert accelerator._dataloaders == [loader], (
        "save_loop_state: Accelerator._dataloaders no longer lists the prepared loaders"
    )
    parameters = list(inspect.signature(save_accelerator_state).parameters)
    assert parameters[:8] == [
        "output_dir",
        "model_states",
        "optimizers",
        "schedulers",
        "dataloaders",
        "process_index",
        "step",
        "scaler",
    ], f"save_loop_state: save_accelerator_state's parameters changed: {parameters}"
    loaded = list(inspect.signature(load_accelerator_state).parameters)
    assert loaded[:8] == [
        "input_dir",
        "models",
        "optimizers",
        "schedulers",
        "dataloaders",
        "process_index",
        "scaler",
        "map_location",
    ], f"load_loop_state: load_accelerator_state's parameters changed: {loaded}"
    accelerator.step = 3
    accelerate_compat.save_loop_state(accelerator, tmp_path)
    assert (tmp_path / "random_states_0.pkl").is_file(), "save_loop_state: no RNG state written"
    drawn = torch.rand(4)
    accelerator.step = 0
    accelerate_compat.load_loop_state(accelerator, tmp_path)
    assert accelerator.step == 3, "load_loop_state: the micro-step count is not restored"
    assert torch.equal(torch.rand(4), drawn), "load_loop_state: the RNG state is not restored"


def test_set_micro_step_is_the_count_accumulate_reads():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    accelerate_compat.set_micro_step(accelerator, 3)
    assert accelerator.step == 3
    assert "self.step" in inspect.getsource(Accelerator._do_sync), (
        "set_micro_step: accumulate no longer counts Accelerator.step"
    )


def test_mark_loader_finished_is_the_key_torchdata_resumes_a_finished_pass_from():
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(list(range(4)), batch_size=2)
    list(loader)
    assert loader.state_dict().get("_iterator_finished") is True, (
        "mark_loader_finished: torchdata's finished-pass key changed"
    )


def test_the_file_names_of_accelerates_checkpoint_parts():
    from accelerate.utils import constants

    assert (constants.MODEL_NAME, constants.FSDP_MODEL_NAME, constants.OPTIMIZER_NAME, constants.SAFE_WEIGHTS_NAME) == (
        "pytorch_model",
        "pytorch_model_fsdp",
        "optimizer",
        "model.safetensors",
    ), "acceltrain.engines: Accelerate renamed its files"


def test_building_fsdp_on_cpu_switches_the_shared_state_it_relies_on():
    from accelerate import PartialState
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    PartialState(cpu=True)
    assert "distributed_type" in PartialState._shared_state, "building_fsdp_on_cpu: PartialState._shared_state changed"
    source = inspect.getsource(AcceleratorState.__init__)
    assert "DistributedType.MULTI_GPU" in source and "DistributedType.FSDP" in source, (
        "building_fsdp_on_cpu: AcceleratorState no longer sets FSDP up in its multi-GPU branch"
    )
    with accelerate_compat.building_fsdp_on_cpu():
        assert PartialState._shared_state["distributed_type"] == DistributedType.MULTI_GPU
    assert PartialState._shared_state["distributed_type"] == DistributedType.MULTI_CPU


@pytest.mark.parametrize("member", ["begin", "end", "end_of_dataloader"])
def test_the_loader_state_protocol_the_on_device_loader_follows(member):
    assert hasattr(accelerate_compat.LoaderStateMixin, member) or member in inspect.getsource(
        accelerate_compat.LoaderStateMixin
    ), f"LoaderStateMixin: Accelerate's loader state lost {member}"
    assert "_drop_last" in inspect.getsource(accelerate_compat.LoaderStateMixin.begin), (
        "LoaderStateMixin: begin no longer reads _drop_last"
    )


def test_deepspeeds_shared_memory_op_is_built_where_the_skip_replaces_it(monkeypatch):
    backend = pytest.importorskip("deepspeed.comm.torch")
    assert callable(getattr(backend, "build_shm_op", None)), "skip_deepspeed_shm_op: build_shm_op is gone"
    assert "build_shm_op()" in inspect.getsource(backend.TorchBackend.__init__), (
        "skip_deepspeed_shm_op: TorchBackend no longer builds its op through build_shm_op"
    )
    monkeypatch.setattr(backend, "build_shm_op", backend.build_shm_op)  # put back after the test
    accelerate_compat.skip_deepspeed_shm_op()
    assert backend.build_shm_op() is None and not hasattr(torch, "build_shm_op")
