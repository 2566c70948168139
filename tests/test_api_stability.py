"""The version story: one version (pyproject.toml's), also for a checkout run uninstalled from PYTHONPATH; no
import path of an unreleased layout survives (there has been no release to keep them for)."""

from __future__ import annotations

import subprocess
import sys

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
