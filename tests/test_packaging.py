"""The recipes ship inside the package (issue 14, items 3 and 4): the wheel installed outside the checkout
runs them (console scripts, ``accelerate launch -m``) and ``acceltrain bench``; presets load by name; a
recipe's ``--help`` imports no torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import REPO, read_summary, subprocess_env

from acceltrain import ConfigError
from acceltrain.config.parser import parse_config

RECIPE_MODULES = (
    "acceltrain.recipes.resnet_cifar",
    "acceltrain.recipes.causal_lm",
    "acceltrain.recipes.text_classification",
)
CHECKOUT_SHIMS = tuple(REPO / "recipes" / f"{name.rsplit('.', 1)[1]}.py" for name in RECIPE_MODULES)


@pytest.mark.parametrize("target", [*RECIPE_MODULES, *map(str, CHECKOUT_SHIMS)])
def test_recipe_help_imports_no_torch(target):
    """--help used to take 3 s here (torch, torchvision, Accelerate imported first); now ~0.1 s."""
    run = "run_module" if target in RECIPE_MODULES else "run_path"
    code = (
        f"import runpy, sys\nsys.argv = [{target!r}, '--help']\n"
        f"try:\n    runpy.{run}({target!r}, run_name='__main__')\n"
        "except SystemExit as stop:\n    assert stop.code in (0, None), stop.code\n"
        "heavy = sorted({'torch', 'torchvision', 'accelerate', 'transformers', 'datasets'} & set(sys.modules))\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--batch-size" in result.stdout and "--model" in result.stdout


@pytest.mark.parametrize("package", ["acceltrain.vision", "acceltrain.text"])
def test_every_public_name_of_the_lazy_packages_imports(package):
    import importlib

    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None, name
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        module.nope  # noqa: B018 - reading it is the test


def test_choices_come_from_the_modules_that_use_them():
    """The torch-free names are the same tuples the datasets, models and tasks check against."""
    from acceltrain.text import lm
    from acceltrain.text import names as text_names
    from acceltrain.train.tasks import ClassificationTask
    from acceltrain.vision import augment, data, models, names

    assert (augment.FLIPS, augment.PADDING_MODES, data.IMAGE_DATASETS) == (
        names.FLIPS,
        names.PADDING_MODES,
        names.IMAGE_DATASETS,
    )
    assert (models.MODELS, models.STEMS, models.RESNETS) == (names.MODELS, names.STEMS, names.RESNETS)
    assert ClassificationTask.tta_modes == names.TTA_MODES
    assert lm.MODEL_PRESETS == text_names.MODEL_PRESETS


def test_a_shipped_preset_loads_by_name_from_anywhere(tmp_path, monkeypatch):
    from acceltrain.recipes.resnet_cifar import CifarConfig

    monkeypatch.chdir(tmp_path)
    for name in ("smoke_cpu", "smoke_cpu.yaml"):
        cfg = parse_config(CifarConfig, ["--config", name, "--lr", "0.2"])
        assert (cfg.model, cfg.dataset, cfg.max_steps, cfg.lr) == ("resnet_tiny", "synthetic", 60, 0.2)
    (tmp_path / "smoke_cpu.yaml").write_text("max_steps: 7\n")  # a file of that name wins over the preset
    assert parse_config(CifarConfig, ["--config", "smoke_cpu.yaml"]).max_steps == 7


def test_an_unknown_preset_name_lists_the_shipped_ones(tmp_path, monkeypatch):
    from acceltrain.recipes.resnet_cifar import CifarConfig

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        parse_config(CifarConfig, ["--config", "smoke_gpu"])
    message = str(err.value)
    assert message.startswith(
        "--config 'smoke_gpu' is neither a file nor a shipped preset: give a YAML file or one of "
    )
    assert "cifar10_fast, " in message and "smoke_cpu" in message and "\n" not in message


def test_the_checkout_presets_are_the_shipped_ones():
    assert (REPO / "recipes" / "configs").resolve() == (REPO / "acceltrain" / "recipes" / "configs").resolve()


def test_bench_refuses_a_recipe_that_is_neither_a_file_nor_a_module(tmp_path):
    from acceltrain.commands.bench import main as bench_main

    assert bench_main(["--recipe", "acceltrain.recipes.nope", "--output-dir", str(tmp_path / "b")]) == 2
    assert bench_main(["--recipe", "nope/resnet_cifar.py", "--output-dir", str(tmp_path / "b")]) == 2
    assert not (tmp_path / "b").exists()


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel in a fresh venv, with no network: the wheel is built from a copy of the sources (nothing
    written into the checkout) with the installed setuptools (``--no-build-isolation``); the venv is made
    ``--without-pip`` and the wheel installed into it with this venv's pip (``--python``, ``--no-index
    --no-deps``). Its dependencies (torch, Accelerate, ...) come from this venv's site-packages through a
    .pth file: appended after the fresh site-packages, so ``acceltrain`` and its metadata are the wheel's,
    and .pth files there (this checkout's editable install) are not run."""
    root = tmp_path_factory.mktemp("packaging")
    source = root / "source"
    shutil.copytree(REPO / "acceltrain", source / "acceltrain", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(root / "dist"), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = (root / "dist").glob("acceltrain-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    subprocess.run(
        [*pip, "--python", str(venv / "bin" / "python"), "install", "--no-index", "--no-deps", str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    fresh_site = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(fresh_site) / "dependencies_from_the_test_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def run_installed(venv: Path, cwd: Path, *command: str) -> subprocess.CompletedProcess:
    env = subprocess_env(
        PATH=f"{venv / 'bin'}:/usr/bin:/bin", HF_HOME=str(cwd / "hf"), HF_HUB_OFFLINE="1", PYTHONPATH=""
    )
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (
        f"{' '.join(command)}: exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result


@pytest.mark.slow
def test_the_installed_wheel_runs_the_recipes_and_bench_outside_the_checkout(installed, tmp_path):
    bin_dir = installed / "bin"
    where = run_installed(
        installed,
        tmp_path,
        str(bin_dir / "python"),
        "-c",
        "import acceltrain.recipes; print(acceltrain.recipes.__file__)",
    )
    assert where.stdout.strip().startswith(str(installed)), "the wheel's acceltrain, not the checkout's"
    tiny = ["--max-steps", "2", "--num-workers", "0", "--report-to", "none", "--no-progress"]

    run_installed(
        installed,
        tmp_path,
        str(bin_dir / "acceltrain-resnet-cifar"),
        "--config",
        "smoke_cpu",
        "--batch-size",
        "8",
        *tiny,
        "--output-dir",
        "console",
    )
    assert read_summary(tmp_path / "console")["config"]["model"] == "resnet_tiny"

    text = tmp_path / "lines.txt"
    text.write_text(
        "".join(f"line {i} of a small text for a tiny tokenizer, the cat sat on mat {i % 7}.\n" for i in range(300))
    )
    run_installed(
        installed,
        tmp_path,
        str(bin_dir / "python"),
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "accelerate_configs" / "cpu.yaml"),
        "-m",
        "acceltrain.recipes.causal_lm",
        "--text-files",
        str(text),
        "--vocab-size",
        "300",
        "--block-size",
        "32",
        "--batch-size",
        "4",
        "--num-proc",
        "1",
        *tiny,
        "--output-dir",
        "lm",
    )
    assert (tmp_path / "lm" / "tokenizer.json").is_file() and (tmp_path / "lm" / "summary.json").is_file()

    run_installed(
        installed,
        tmp_path,
        str(bin_dir / "acceltrain"),
        "bench",
        "--rows",
        "fp32",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--batch-size",
        "8",
        "--output-dir",
        "bench",
    )
    (row,) = json.loads((tmp_path / "bench" / "bench.json").read_text())["rows"]
    assert row["status"] == "ok" and row["figures"]["samples_per_second"] > 0
    assert (tmp_path / "bench" / "bench.md").is_file()
