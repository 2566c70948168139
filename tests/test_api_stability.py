"""The version story: one version (pyproject.toml's), also for a checkout run uninstalled from PYTHONPATH; no
import path of an unreleased layout survives (there has been no release to keep them for)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
from conftest import REPO, subprocess_env


def test_an_uninstalled_checkout_has_pyprojects_version():
    """Before: ``version("acceltrain")`` raised PackageNotFoundError when the checkout ran from PYTHONPATH."""
    code = (
        "import importlib.metadata as metadata\n"
        "def version(name):\n"
        "    raise metadata.PackageNotFoundError(name)\n"
        "metadata.version = version\n"
        "import acceltrain; print(acceltrain.__version__)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=subprocess_env(PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    expected = next(
        line.split('"')[1]
        for line in (REPO / "pyproject.toml").read_text().splitlines()
        if line.startswith("version = ")
    )
    assert result.stdout.strip() == f"{expected}+checkout"


@pytest.mark.parametrize(
    "old",
    [
        "acceltrain.checkpointing",
        "acceltrain.sharding",
        "acceltrain.async_checkpoint",
        "acceltrain.device_loader",
        "acceltrain.lm",
        "acceltrain.models",
        "acceltrain.profiling",
        "acceltrain.loop",
        "acceltrain.cli",
    ],
)
def test_no_import_path_of_the_unreleased_layouts_survives(old):
    """No shim: nothing was released, so the only paths are the subpackages' (issue 44)."""
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


def test_the_public_names_and_python_dash_m_work():
    import acceltrain

    for name in acceltrain.__all__:
        assert getattr(acceltrain, name) is not None, name
    result = subprocess.run(
        [sys.executable, "-m", "acceltrain", "--version"], env=subprocess_env(), capture_output=True, text=True
    )
    assert result.returncode == 0 and acceltrain.__version__ in result.stdout, result.stderr
