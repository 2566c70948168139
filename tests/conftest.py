"""Shared fixtures: fresh Accelerate state per test, subprocess launchers, tiny generated data."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "resnet_cifar.py"
TINY_RECIPE = REPO / "tests" / "helpers" / "tiny_recipe.py"
# One torch thread in each pytest worker, as in the launched processes (OMP_NUM_THREADS=1 below): two workers
# on two cores with two threads each oversubscribe the cores, and the tests' models are too small to gain.
torch.set_num_threads(1)


def reset_accelerate_state() -> None:
    """Accelerate's state objects are process-wide singletons; in-process runs must not share them."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def fresh_accelerate_state(monkeypatch, tmp_path_factory):
    """Also: no W&B unless a test asks for it (the default --report-to is wandb); decoded images cached in
    the tests' temporary folder, never in the user's ~/.cache."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("ACCELTRAIN_CACHE", str(tmp_path_factory.getbasetemp() / "acceltrain-cache"))
    yield
    reset_accelerate_state()


def run_tiny_in_process(output_dir: Path | None, *args: str, hooks=(), task=None) -> int:
    """tests/helpers/tiny_recipe.py in this process, as ``run_recipe`` runs it; returns its exit code (0; 75
    when it stopped to be resumed; 2 on bad input). ``hooks``/``task`` go to ``fit``."""
    sys.path.insert(0, str(TINY_RECIPE.parent))
    import tiny_recipe

    from acceltrain import run_recipe

    reset_accelerate_state()
    where = ["--output-dir", str(output_dir)] if output_dir is not None else []
    try:
        run_recipe(lambda cfg: tiny_recipe.main(cfg, hooks=hooks, task=task), tiny_recipe.TinyConfig, [*where, *args])
    except SystemExit as stop:
        return stop.code
    return 0


def subprocess_env(**extra: str) -> dict[str, str]:
    """A clean environment: no W&B (unless ``extra`` asks), one thread per process; '' unsets a variable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    for key, value in extra.items():
        if value:
            env[key] = value
        else:
            env.pop(key, None)
    return env


def launch(
    script: Path,
    args: list[str],
    *,
    processes: int = 1,
    launcher: str = "python",
    config: str = "multi_cpu.yaml",
    launcher_args: tuple[str, ...] = (),
    timeout: int = 300,
    **env: str,
) -> subprocess.CompletedProcess:
    """Run ``script`` as a user would: plain python, torchrun, accelerate launch with a shipped config, or
    ``acceltrain ft-launch`` with ``processes`` replica groups ("ft")."""
    if launcher == "python":
        command = [sys.executable, str(script)]
    elif launcher == "torchrun":
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(processes),
            "--master_port",
            str(_free_port()),
            str(script),
        ]
    elif launcher == "accelerate":
        command = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(REPO / "accelerate_configs" / config),
            *launcher_args,
            "--num_processes",
            str(processes),
            "--main_process_port",
            str(_free_port()),
            str(script),
        ]
    elif launcher == "ft":
        command = [sys.executable, "-m", "acceltrain", "ft-launch", "--replica-groups", str(processes), str(script)]
    else:
        raise ValueError(launcher)
    return subprocess.run(
        command + args, cwd=REPO, env=subprocess_env(**env), capture_output=True, text=True, timeout=timeout
    )


def check(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, (
        f"exit {result.returncode}\n--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}"
    )
    return result


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read_summary(output_dir: Path) -> dict:
    return json.loads((output_dir / "summary.json").read_text())


def read_events(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def image_folder(tmp_path: Path) -> Path:
    """A tiny ImageFolder tree: 3 classes, 12 train + 4 test JPEGs each, 40x40 (so they get resized)."""
    from PIL import Image

    root = tmp_path / "folder"
    generator = torch.Generator().manual_seed(0)
    for split, count in (("train", 12), ("test", 4)):
        for label, name in enumerate(("cat", "dog", "frog")):
            folder = root / split / name
            folder.mkdir(parents=True)
            for index in range(count):
                image = torch.randint(0, 60, (3, 40, 40), generator=generator, dtype=torch.uint8) + 80 * label
                Image.fromarray(image.permute(1, 2, 0).numpy()).save(folder / f"{index:03d}.jpg")
    return root


def docs_block(page: str, marker: str) -> str:
    """The python block of ``docs/<page>`` that contains ``marker``."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / page).read_text(), re.S)
    return next(block for block in blocks if marker in block)


def docs_example(page: str, marker: str) -> dict:
    """The namespace of that block, run as written."""
    namespace: dict = {"__name__": "docs_example"}
    exec(compile(docs_block(page, marker), f"docs/{page}", "exec", dont_inherit=True), namespace)  # noqa: S102
    return namespace


class EventRecorder:
    """A hook that records the events of the original protocol with where the run stands at each."""

    def __init__(self):
        self.events = []

    def on_fit_start(self, run):
        self.events.append(("fit_start", run.step))

    def on_epoch_start(self, run):
        self.events.append(("epoch_start", run.epoch))

    def on_step_end(self, run):
        self.events.append(("step_end", run.step))

    def on_log(self, run, metrics):
        self.events.append(("log", metrics["step"], "loss" in metrics))

    def on_eval_start(self, run):
        self.events.append(("eval_start", run.step))

    def on_eval_end(self, run, metrics):
        self.events.append(("eval_end", run.step))

    def on_save(self, run, folder):
        self.events.append(("save", Path(folder).name))

    def on_train_end(self, run):
        self.events.append(("train_end", run.step))

    def on_fit_end(self, run, summary):
        self.events.append(("fit_end", summary["steps"]))


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where CUDA is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
