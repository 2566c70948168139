"""--freeze-whitening-bias-after-epochs: airbench94 trains its whitening conv's bias for 3 epochs only."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from acceltrain.checkpoint.files import complete_checkpoints
from acceltrain.commands.cli import run_recipe
from acceltrain.recipes.resnet_cifar import CifarConfig
from acceltrain.recipes.resnet_cifar import main as cifar_main

FAST = [  # on the tiny ImageFolder tree (36 training images): 4 steps an epoch
    "--dataset",
    "imagefolder",
    "--model",
    "fast_cifar",
    "--whiten-first-conv",
    "--batch-size",
    "9",
    "--epochs",
    "2",
    "--lookahead-decay",
    "0.95",
    "--lookahead-every",
    "2",
    "--eval-every",
    "100",
    "--no-progress",
    "--report-to",
    "none",
    "--num-workers",
    "0",
    "--freeze-whitening-bias-after-epochs",
    "1",
]


def train(out, images, *extra: str) -> int:
    try:
        run_recipe(cifar_main, CifarConfig, [*FAST, "--data-dir", str(images), "--output-dir", str(out), *extra])
    except SystemExit as exit_info:
        return exit_info.code
    return 0


def bias(folder) -> list[float]:
    return load_file(str(folder / "model.safetensors"))["whiten.bias"].tolist()


@pytest.mark.slow
def test_the_bias_trains_for_the_given_epochs_then_stays_put_through_the_lookahead_and_a_resume(tmp_path, image_folder):
    """4 steps an epoch: the bias moves between the checkpoints of steps 2 and 4, and every later step keeps
    the value of step 4 (the start of epoch 1), lookahead updates included."""
    full, branch = tmp_path / "full", tmp_path / "branch"
    assert train(full, image_folder, "--save-every-steps", "2", "--keep-last", "4") == 0
    step_2, step_4, step_6, _ = complete_checkpoints(full)
    assert (step_2.name, step_4.name, step_6.name) == ("step_00000002", "step_00000004", "step_00000006")
    assert bias(step_2) != bias(step_4) and bias(full) == bias(step_4)
    assert train(branch, image_folder, "--resume", str(step_6)) == 0  # the resume continues the freeze
    assert (branch / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--no-whiten-first-conv"], "unset without --whiten-first-conv"),
        (["--model", "resnet_tiny"], "resnet_tiny's first conv has no bias to freeze"),
    ],
)
def test_a_freeze_without_a_whitening_bias_is_one_line(tmp_path, image_folder, capsys, flags, message):
    assert train(tmp_path / "run", image_folder, *flags) == 2
    assert message in capsys.readouterr().err
