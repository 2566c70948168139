"""The code base keeps to the lint and format configured in pyproject.toml (``[tool.ruff]``: line length 120,
rules E, F, W, I), so CI enforces it: ``ruff check .`` and ``ruff format --check .`` from the repository root
both pass."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO

pytest.importorskip("ruff", reason="ruff is not installed (it is in the test extra: pip install -e '.[test]')")


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_ruff_check_passes():
    result = _ruff("check", ".")
    assert result.returncode == 0, f"ruff check . failed:\n{result.stdout}{result.stderr}"


def test_ruff_format_check_passes():
    result = _ruff("format", "--check", ".")
    assert result.returncode == 0, f"ruff format --check . failed (run ruff format .):\n{result.stdout}{result.stderr}"
