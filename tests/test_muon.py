"""--optimizer muon: torch.optim.Muon on the hidden matrices (conv kernels seen as matrices), SGD on the rest,
as one optimizer that Accelerate prepares and checkpoints and the schedule drives."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from acceltrain import TrainConfig, parse_config
from acceltrain.commands.cli import run_recipe
from acceltrain.recipes.resnet_cifar import CifarConfig
from acceltrain.recipes.resnet_cifar import main as cifar_main
from acceltrain.train.optim import MuonWithSGD, build_optimizer, muon_parameters

MUON = ["--optimizer", "muon", "--muon-lr", "0.05", "--muon-momentum", "0.6"]


def small_net() -> nn.Module:
    return nn.Sequential(
        nn.Embedding(5, 3), nn.Linear(3, 4), nn.LayerNorm(4), nn.Conv1d(4, 4, 3), nn.Flatten(), nn.Linear(8, 2)
    )


def test_muon_takes_the_hidden_matrices_and_sgd_everything_else():
    model = small_net()
    optimizer = build_optimizer(model, parse_config(TrainConfig, MUON))
    names = {id(p): name for name, p in model.named_parameters()}
    assert isinstance(optimizer, MuonWithSGD)
    assert sorted(names[id(p)] for p in optimizer.param_groups[0]["params"]) == ["1.weight", "3.weight"]
    assert optimizer.param_groups[0]["lr"] == 0.05 and optimizer.param_groups[0]["momentum"] == 0.6
    rest = sorted(names[id(p)] for group in optimizer.param_groups[1:] for p in group["params"])
    assert rest == ["0.weight", "1.bias", "2.bias", "2.weight", "3.bias", "5.bias", "5.weight"], (
        "embedding, head, vectors"
    )
    assert muon_parameters(model) == {id(model[1].weight), id(model[3].weight)}


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_a_kernel_steps_as_torchs_muon_steps_its_matrix_even_after_it_moved(memory_format):
    """The kernel is converted after the optimizer was built (as fit() does for --channels-last): the update
    must land in the kernel the model uses, and equal torch's Muon on the flattened matrix."""
    conv = nn.Conv2d(3, 4, 2)
    reference = nn.Parameter(conv.weight.detach().clone().reshape(4, -1))
    optimizer = MuonWithSGD(
        [conv.weight], torch.optim.SGD([conv.bias], lr=0.1), lr=0.1, momentum=0.6, weight_decay=0.01
    )
    expected = torch.optim.Muon([reference], lr=0.1, momentum=0.6, weight_decay=0.01, nesterov=True)
    conv.to(memory_format=memory_format)
    for _ in range(3):
        grad = torch.randn(4, 3, 2, 2)
        conv.weight.grad = grad.contiguous(memory_format=memory_format)
        reference.grad = grad.reshape(4, -1)
        optimizer.step()
        expected.step()
    torch.testing.assert_close(conv.weight.detach().reshape(4, -1), reference.detach())


def test_state_dict_round_trips_and_the_schedule_reaches_both_optimizers():
    model = small_net()
    optimizer = build_optimizer(model, parse_config(TrainConfig, MUON))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    assert [group["lr"] for group in optimizer.param_groups][:2] == [0.025, parse_config(TrainConfig, MUON).lr * 0.5]
    model(torch.tensor([[1, 2, 3, 4]])).sum().backward()
    optimizer.step()
    state = optimizer.state_dict()
    fresh = build_optimizer(small_net(), parse_config(TrainConfig, MUON))
    fresh.load_state_dict(state)
    assert fresh.param_groups[0]["lr"] == 0.025 and fresh.param_groups[1] is fresh.sgd.param_groups[0]
    assert torch.equal(
        fresh.muon.state_dict()["state"][0]["momentum_buffer"], state["muon"]["state"][0]["momentum_buffer"]
    )
    scheduler.step()


def test_a_model_without_hidden_matrices_is_one_line():
    with pytest.raises(Exception, match="--optimizer muon found no hidden weight matrices"):
        build_optimizer(nn.Sequential(nn.Linear(3, 2)), parse_config(TrainConfig, MUON))


def train(out, *extra: str) -> int:
    args = [
        "--dataset",
        "synthetic",
        "--model",
        "resnet_tiny",
        "--batch-size",
        "16",
        "--max-steps",
        "6",
        "--eval-every",
        "3",
        "--no-progress",
        "--report-to",
        "none",
        "--num-workers",
        "0",
        "--output-dir",
        str(out),
        *MUON,
        *extra,
    ]
    try:
        run_recipe(cifar_main, CifarConfig, args)
    except SystemExit as exit_info:
        return exit_info.code
    return 0


@pytest.mark.slow
def test_a_muon_run_resumes_byte_identical(tmp_path):
    assert train(tmp_path / "full") == 0
    assert train(tmp_path / "cut", "--stop-after-steps", "3") == 75
    assert train(tmp_path / "cut", "--resume", "auto") == 0
    assert (tmp_path / "cut" / "model.safetensors").read_bytes() == (
        tmp_path / "full" / "model.safetensors"
    ).read_bytes()


SMALL = [
    "--dataset",
    "synthetic",
    "--model",
    "resnet_tiny",
    "--max-steps",
    "4",
    "--no-progress",
    "--report-to",
    "none",
    "--num-workers",
    "0",
    *MUON,
]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_at_batch_b_match_one_process_at_batch_2b(tmp_path):
    """DDP averages the gradients before Muon orthogonalises them: the same update as one big batch, up to
    the rounding of torch's Newton-Schulz iteration, which runs in bfloat16."""
    from conftest import RECIPE, check, launch
    from safetensors.torch import load_file

    two_steps = [*SMALL, "--max-steps", "2"]  # later steps compound the bfloat16 rounding
    check(
        launch(
            RECIPE,
            [*two_steps, "--batch-size", "8", "--sync-bn", "--output-dir", str(tmp_path / "ddp")],
            processes=2,
            launcher="accelerate",
        )
    )
    check(launch(RECIPE, [*two_steps, "--batch-size", "16", "--output-dir", str(tmp_path / "single")]))
    ddp, single = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("ddp", "single"))
    for key in single:
        assert (ddp[key].float() - single[key].float()).norm() <= 2e-2 * single[key].float().norm() + 1e-6, key


@pytest.mark.slow
def test_muon_under_deepspeed_is_one_line_before_training(tmp_path):
    pytest.importorskip("deepspeed")
    from conftest import RECIPE, launch

    result = launch(
        RECIPE, [*SMALL, "--output-dir", str(tmp_path / "out")], launcher="accelerate", config="deepspeed_zero2.yaml"
    )
    assert (
        result.returncode != 0
        and "error: --optimizer muon needs every weight matrix whole on each process, and DeepSpeed" in result.stderr
    )
    assert not (tmp_path / "out").exists()
