"""Names keep working where a recipe written against an earlier layout imports them, with a warning that
names the new place; a checkout runs uninstalled from PYTHONPATH."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest
from conftest import REPO, subprocess_env


@pytest.mark.parametrize(
    ("old", "name", "new"),
    [
        ("acceltrain.data", "image_datasets", "acceltrain.vision"),
        ("acceltrain.data", "ImageClassification", "acceltrain.vision"),
        ("acceltrain.data", "IMAGE_DATASETS", "acceltrain.vision"),
        ("acceltrain.data", "scan_image_folder", "acceltrain.vision.data"),
    ],
)
def test_a_name_moved_out_of_a_module_imports_with_a_warning(old, name, new):
    """Before: commit 128a42a moved image_datasets to acceltrain.vision and the old import failed."""
    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=rf"{old}\.{name} moved to {new}\.{name}: import it from there"):
        value = getattr(module, name)
    assert value is getattr(importlib.import_module(new), name)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("old", "new", "name"),
    [
        ("acceltrain.lm", "acceltrain.text.lm", "CausalLMTask"),
        ("acceltrain.models", "acceltrain.vision.models", "build_model"),
        ("acceltrain.device_loader", "acceltrain.vision.device_loader", "DeviceImageLoader"),
        ("acceltrain.profiling", "acceltrain.hooks.profiling", "Profiler"),
    ],
)
def test_a_moved_module_imports_with_a_warning_at_the_importers_line(old, new, name):
    """A fresh process, as a recipe imports it: the warning points at the recipe's line, not importlib's."""
    code = (
        f"import warnings; warnings.simplefilter('always')\nfrom {old} import {name}\n"
        f"import {new}; assert {name} is {new}.{name}"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert f"<string>:2: DeprecationWarning: {old} moved to {new}: import from there" in result.stderr


def test_an_unknown_name_of_a_module_with_moved_names_is_still_an_attribute_error():
    import acceltrain.data

    with warnings.catch_warnings(), pytest.raises(AttributeError, match="has no attribute 'nope'"):
        warnings.simplefilter("error")
        acceltrain.data.nope  # noqa: B018


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
