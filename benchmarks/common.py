"""Helpers shared by the benchmark scripts: which machine ran them, where results go, the real CIFAR-10
(extracted once from ../shared), in-process and subprocess runs of the acceltrain loop.

The scripts import it as ``from common import ...`` (``python benchmarks/<name>.py`` puts this folder
on ``sys.path``).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results"
DATA_DIR = REPO / "benchmarks" / ".data"  # extracted datasets; holds its own .gitignore
DATASETS = REPO.parent / "shared" / "datasets"  # beside the checkout: benchmarks only, never the tests
CIFAR10_ARCHIVE = DATASETS / "cifar10-jpeg.tar.gz"
TINYSHAKESPEARE = DATASETS / "tinyshakespeare.txt"
DEBIAN = DATASETS / "debian-sections"  # debian-sections: train.csv, eval.csv (7 classes)
RECIPE = REPO / "recipes" / "resnet_cifar.py"


# --------------------------------------------------------------------------- the machine


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """What the numbers were measured on: CPU model and cores, accelerator, library versions, date."""
    import accelerate

    from acceltrain.data.loaders import available_cpus

    return {
        "cpu": cpu_model(),
        "cpu_cores": available_cpus(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "accelerate": accelerate.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,  # shared machines are noisy
    }


def machine_line(info: dict) -> str:
    gpu = f", GPU {info['gpu']}" if info["gpu"] else ", no GPU"
    load = f", load {info['load_average'][0]:.1f}" if info["load_average"] else ""
    return (
        f"machine: {info['cpu']}, {info['cpu_cores']} cores{gpu}, torch {info['torch']}, "
        f"accelerate {info['accelerate']}, {info['date']}{load}"
    )


def start(title: str) -> dict:
    """Print the benchmark's title and the machine line; return the machine description for the JSON."""
    info = machine()
    print(title)
    print(machine_line(info), flush=True)
    return info


def write_result(name: str, info: dict, result: dict) -> Path:
    """``benchmarks/results/<name>.json``: the machine description plus ``result``."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps({"benchmark": name, "machine": info, **result}, indent=2) + "\n")
    print(f"wrote {path.relative_to(REPO)}")
    return path


def verdict(ratio: float, target: float, at_least: bool) -> str:
    met = ratio >= target if at_least else ratio <= target
    return f"target {'>=' if at_least else '<='} {target:g}: {'met' if met else 'NOT met'}"


def chosen(parser, value: str, allowed: tuple[str, ...], what: str) -> list[str]:
    """A comma-separated choice flag (``--legs a,b``) as its list; an unknown item is the parser's error."""
    picked = [item for item in value.split(",") if item]
    if unknown := [item for item in picked if item not in allowed]:
        parser.error(f"unknown {what} {unknown}: choose from {', '.join(allowed)}")
    return picked


def cpu_bf16_flags() -> list[str]:
    """The CPU's flags that run bf16 matmuls natively (empty: none, or not Linux)."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return sorted(flag for flag in flags.split(":", 1)[1].split() if flag in ("amx_bf16", "avx512_bf16", "amx_tile"))


def median(values: list[float]) -> float:
    return statistics.median(values)


# --------------------------------------------------------------------------- data


def cifar10_jpeg() -> Path | None:
    """The real CIFAR-10 as an ImageFolder tree (``train/<class>/*.jpg``, ``test/...``), extracted from
    ``../shared/datasets/cifar10-jpeg.tar.gz`` into ``benchmarks/.data/cifar10-jpeg`` the first time.
    None, with a message saying why, when the archive is absent."""
    target = DATA_DIR / "cifar10-jpeg"
    if (target / "train").is_dir() and (target / "test").is_dir():
        return target
    if not CIFAR10_ARCHIVE.is_file():
        print(f"skipped: {CIFAR10_ARCHIVE} is absent (the CIFAR-10 JPEG archive; see ../shared/README.md)")
        return None
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    (DATA_DIR / ".gitignore").write_text("*\n")  # nothing extracted here is ever committed
    partial = DATA_DIR / f".cifar10-jpeg.{os.getpid()}.tmp"
    print(f"extracting {CIFAR10_ARCHIVE.name} into {target.relative_to(REPO)} (once)", flush=True)
    with tarfile.open(CIFAR10_ARCHIVE) as archive:
        archive.extractall(partial, filter="data")
    os.replace(partial, target)  # a half-extracted tree is never taken for a complete one
    return target


# --------------------------------------------------------------------------- running the loop


def reset_accelerate_state() -> None:
    """Accelerate's state objects are process-wide singletons: reset them between in-process ``fit`` calls."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def quiet_env() -> dict[str, str]:
    """The environment for a recipe subprocess: no W&B, no inherited Accelerate settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "ACCELERATE_"))}
    env.update(WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    return env


def run_recipe_process(output_dir: Path, args: list[str], recipe: Path = RECIPE, timeout: float | None = None) -> dict:
    """Run a recipe in a fresh ``python`` process (``--report-to none --no-progress``, its own output folder)
    and return its summary.json, with the events of its metrics.jsonl under ``"events"``."""
    command = [
        sys.executable,
        str(recipe),
        *args,
        "--output-dir",
        str(output_dir),
        "--overwrite",
        "--report-to",
        "none",
        "--no-progress",
    ]
    done = subprocess.run(command, cwd=REPO, env=quiet_env(), capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    summary = json.loads((output_dir / "summary.json").read_text())
    metrics = output_dir / "metrics.jsonl"
    summary["events"] = (
        [json.loads(line) for line in metrics.read_text().splitlines() if line] if metrics.exists() else []
    )
    return summary
