"""The ``acceltrain`` command: a help that answers at once, --version, and ``acceltrain env``."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

import pytest
import torch
from conftest import REPO, subprocess_env

import acceltrain
from acceltrain.commands.cli import environment_report

HEAVY = ("torch", "accelerate", "transformers")


def modules_loaded_by(code: str) -> list[str]:
    """Which of HEAVY a fresh interpreter has imported after running ``code``."""
    probe = f"import sys\n{code}\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()[-1].split() if result.stdout.strip() else []


@pytest.mark.parametrize(
    "code",
    [
        "import acceltrain.config.train_config, acceltrain.commands.cli",
        "from acceltrain import TrainConfig, option, require, ConfigError",
        "from acceltrain.commands.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass",
        "from acceltrain.commands.cli import main\ntry:\n    main(['bench', '--help'])\nexcept SystemExit:\n    pass",
        "from acceltrain.commands.cli import main\ntry:\n    main(['predict', '--help'])\nexcept SystemExit:\n    pass",
    ],
)
def test_help_and_the_config_import_neither_torch_nor_accelerate(code):
    """Before: importing acceltrain imported everything, seconds before the first line of --help."""
    assert modules_loaded_by(code) == []


def test_every_public_name_still_imports_from_the_package():
    for name in acceltrain.__all__:
        assert getattr(acceltrain, name) is not None
    from acceltrain import fit, run_recipe

    assert callable(fit) and callable(run_recipe)
    with pytest.raises(AttributeError, match="no attribute 'fitt'"):
        acceltrain.fitt  # noqa: B018


def test_version_and_a_plain_text_help():
    """--version answers without importing the heavy libraries (measured by what is imported, not by the clock)."""
    probe = (
        "import runpy, sys; sys.argv = ['acceltrain', '--version']\n"
        "try:\n    runpy.run_module('acceltrain.commands.cli', run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "print(sorted(name for name in ('torch', 'accelerate', 'transformers', 'datasets') if name in sys.modules))"
    )
    shown = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120
    )
    assert shown.stdout.splitlines() == [f"acceltrain {version('acceltrain')}", "[]"], shown.stdout + shown.stderr
    assert version("acceltrain") == acceltrain.__version__
    helped = subprocess.run(
        [sys.executable, "-m", "acceltrain.commands.cli", "--help"],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert helped.returncode == 0 and "env" in helped.stdout and "``" not in helped.stdout, helped.stdout


def test_env_reports_what_accelerate_env_does_and_the_toolkit_view():
    report = environment_report()
    assert report["accelerate env"]["`Accelerate` version"] == version("accelerate")
    assert "PyTorch version" in report["accelerate env"] and "`Accelerate` configs" in report["accelerate env"]
    toolkit = report["acceltrain"]
    assert toolkit["version"] == acceltrain.__version__ and toolkit["libraries"]["transformers"] == version(
        "transformers"
    )
    if torch.cuda.is_available():  # the GPUs of the peak table (H100, A100, ...): known
        assert toolkit["training device"].startswith(
            f"cuda: {torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
        )
    else:
        assert toolkit["training device"].startswith("cpu: ")
        peaks = toolkit["peak FLOP/s for MFU"]
        assert peaks.startswith("fp32 measured ") and "datasheet" not in peaks and "--peak-tflops" in peaks
    assert toolkit["bf16"].startswith(("fast: matmul", "slow: matmul")) and "conv" in toolkit["bf16"]


@pytest.mark.slow
def test_env_command_prints_both_sections():
    result = subprocess.run(
        [sys.executable, "-m", "acceltrain.commands.cli", "env"],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert (
        result.stdout.startswith("accelerate env:\n")
        and "\nacceltrain:\n" in result.stdout
        and "  bf16: " in result.stdout
    )
