"""acceltrain bench: the same model and data through a ladder of speed configurations, each in a
fresh process (one row cannot pollute the next: allocator state, compile caches, threads), then the
scaling rows with more processes. Every figure comes from the recipe's own summary.json: steady
state after --warmup steps, device synchronised, evaluation excluded."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from acceltrain.commands.bench_report import Row, _loads, plot, render
from acceltrain.commands.recipe_loading import (
    DEFAULT_RECIPE,
    is_script,
    module_exists,
    recipe_config_class,
    unrecognized_arguments,
)

LADDER = ("fp32", "mixed-precision", "channels-last", "compile", "device-loader", "auto-batch-size")


def ladder_steps(args, mixed_precision: str) -> list[tuple[str, list[str]]]:
    """The rows picked by ``--rows``, each with the flags it adds to the fastest configuration so far.
    A later ``--mixed-precision`` or ``--batch-size`` overrides an earlier one (argparse keeps the last)."""
    additions = {
        "fp32": ["--mixed-precision", "no"],
        "mixed-precision": ["--mixed-precision", mixed_precision],
        "channels-last": ["--channels-last"],
        "compile": ["--compile"],
        "device-loader": ["--data-on-device"],
        "auto-batch-size": ["--auto-batch-size", "--batch-size", str(args.batch_size * 4), "--no-keep-effective-batch"],
    }
    return [(name, additions[name]) for name in LADDER if name in args.rows]


def run_ladder(steps: list[tuple[str, list[str]]], args, out: Path, mixed_precision: str) -> list[Row]:
    """Each row adds its technique to the fastest configuration so far. A technique that makes it slower
    (bf16 autocast on a CPU without AVX-512 BF16, compile on a tiny model) is shown with its figures and
    left out of the rows after it, so every later row still measures its own technique on the best base."""
    rows, base_flags, base_rate = [], [], None
    for position, (name, addition) in enumerate(steps):
        row = Row(name, [*_without_options(base_flags, addition), *addition])
        reason = skip_reason(row, mixed_precision, args.on_cuda)
        if reason:
            row.status = f"skipped: {reason}"
        else:
            run_row(row, args, out, position)
        rate = row.figures.get("samples_per_second")
        if rate is not None and (base_rate is None or rate >= base_rate):
            base_flags, base_rate = row.flags, rate
        elif rate is not None:
            row.kept = False
        print(
            f"{row.name}: {row.status}{'' if row.kept else ' (slower: not kept)'} "
            f"{json.dumps(row.figures) if row.figures else ''}",
            flush=True,
        )
        rows.append(row)
    return rows


def _without_options(flags: list[str], replacing: list[str]) -> list[str]:
    """``flags`` less the ``--option value`` pairs that ``replacing`` sets again (``--mixed-precision``)."""
    options = {
        flag
        for flag, value in zip(replacing, [*replacing[1:], None], strict=True)
        if flag.startswith("--") and value and not value.startswith("--")
    }
    kept, skip_value = [], False
    for flag in flags:
        if skip_value:
            skip_value = False
        elif flag in options:
            skip_value = True
        else:
            kept.append(flag)
    return kept


def skip_reason(row: Row, mixed_precision: str, on_cuda: bool) -> str | None:
    """Rows that cannot run here, said before trying."""
    if "--compile" in row.flags and not on_cuda and shutil.which(os.environ.get("CXX", "g++")) is None:
        return "torch.compile on CPU needs a C++ compiler (g++), none found"
    if mixed_precision == "fp16" and not on_cuda:
        return "fp16 needs a CUDA GPU"
    return None


def run_row(row: Row, args, out: Path, position: int) -> None:
    """One row in a fresh process: the recipe under ``python``, or torchrun for several processes (the
    launcher Accelerate uses for DDP, with no accelerate config file to find: the rows' flags alone set the
    run, as on one process), its progress shown from its metrics.jsonl, its figures read from its summary.json."""
    from tqdm.auto import tqdm

    row_dir = out / "rows" / f"{position:02d}-{row.name}"
    if row_dir.exists():
        shutil.rmtree(row_dir)
    total = args.warmup + args.steps
    recipe_args = [*recipe_arguments(args, row_dir), *row.flags, *args.recipe_args]
    recipe = [args.recipe] if is_script(args.recipe) else ["-m", args.recipe]
    if row.processes > 1:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(row.processes),
            *recipe,
            *recipe_args,
        ]
    else:
        command = [sys.executable, *recipe, *recipe_args]
    log_path = out / "rows" / f"{position:02d}-{row.name}.log"  # rows/: made by make_output_dir
    bar = tqdm(total=total, desc=f"{row.name} x{row.processes}", leave=False, disable=None)  # None: only on a terminal
    with open(log_path, "w") as log, bar:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "WANDB_MODE": "disabled"}
        )
        while process.poll() is None:
            time.sleep(0.5)
            bar.n = _steps_done(row_dir / "metrics.jsonl")
            bar.refresh()
    if process.returncode != 0:
        row.status = f"skipped: {_reason(log_path.read_text())}"
        return
    summary = json.loads((row_dir / "summary.json").read_text())
    memory = summary.get("peak_allocated_mb", summary.get("peak_rss_mb"))
    row.figures = {
        "samples_per_second": summary["samples_per_second"],
        "ms_per_step": summary["ms_per_step"],
        "peak_memory_mb": memory,
        "mfu": summary.get("mfu"),
        "batch_size": summary["config"]["batch_size"],
        "compile_seconds": summary.get("compile_seconds"),
    }


def recipe_arguments(args, row_dir: Path) -> list[str]:
    """The flags bench gives the recipe in every row, before the row's own and the user's extra ones."""
    return [
        "--dataset",
        args.dataset,
        "--model",
        args.model,
        "--batch-size",
        str(args.batch_size),
        "--max-steps",
        str(args.warmup + args.steps),
        "--timing-warmup-steps",
        str(args.warmup),
        "--log-every",
        "1",
        "--report-to",
        "none",
        "--no-progress",
        "--output-dir",
        str(row_dir),
    ]


def _steps_done(metrics: Path) -> int:
    try:
        return sum(1 for line in metrics.read_text().splitlines() if '"loss"' in line)
    except OSError:
        return 0


def _reason(log: str) -> str:
    """The most telling line of a failed row: the toolkit's own error, an out-of-memory, or the last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for marker in ("error: ", "OutOfMemoryError", "out of memory", "Error"):
        for line in reversed(lines):
            if marker in line:
                return line[:200]
    return lines[-1][:200] if lines else "failed without output"


def machine_description(on_cuda: bool) -> str:
    import platform

    import torch

    if on_cuda:
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    cpu = platform.processor() or "CPU"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, no GPU, torch {torch.__version__}"


def check_recipe_arguments(config_class: type, args, parser: argparse.ArgumentParser, out: Path) -> None:
    """The rows' command line as the recipe will parse it, checked once here: a flag neither bench nor the
    recipe knows, a ``--model`` the recipe does not offer, a bad value of a recipe flag."""
    import dataclasses

    from acceltrain.config.options import ConfigError, flag_name
    from acceltrain.config.parser import build_parser as recipe_parser
    from acceltrain.config.parser import parse_config

    recipe_flags = [f"--{flag_name(field.name)}" for field in dataclasses.fields(config_class)]
    missing = [flag for flag in ("--model", "--dataset") if flag not in recipe_flags]
    if missing:
        raise ConfigError(
            f"--recipe {args.recipe!r} has no {', '.join(missing)}: bench gives every row --model and "
            f"--dataset (as {DEFAULT_RECIPE} takes them)"
        )
    _, unknown = recipe_parser(config_class).parse_known_args(args.recipe_args)
    if unknown:
        raise unrecognized_arguments(
            unknown,
            parser,
            recipe_flags,
            "neither a bench flag nor one of the recipe's: acceltrain bench --help, and the recipe's --help",
        )
    parse_config(config_class, [*recipe_arguments(args, out / "rows"), *args.recipe_args])


def make_output_dir(path: str) -> Path:
    """``--output-dir`` with its rows folder, made before any row runs: an existing file there, or a place
    that cannot hold a folder (``/proc``), is one line now rather than a traceback."""
    from acceltrain.config.options import ConfigError, first_line

    out = Path(path)
    try:
        (out / "rows").mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"--output-dir {path!r} cannot be written: {first_line(err)}") from None
    return out


def build_parser() -> argparse.ArgumentParser:
    from acceltrain.config.parser import OneLineParser

    parser = OneLineParser(prog="acceltrain bench", description=__doc__, allow_abbrev=False)  # --step is a typo
    parser.add_argument(
        "--recipe",
        default=DEFAULT_RECIPE,
        help="recipe to run: an installed module (python -m) or a script path (default: %(default)s)",
    )
    parser.add_argument("--model", default="resnet_tiny", help="the recipe's --model (default: %(default)s)")
    parser.add_argument("--dataset", default="synthetic", help="the recipe's --dataset (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=64, help="per-process batch (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps per row (default: %(default)s)")
    parser.add_argument(
        "--warmup", type=int, default=5, help="untimed steps first, compilation included (default: %(default)s)"
    )
    parser.add_argument(
        "--rows", default=",".join(LADDER), help="ladder rows to run (default: all): " + ", ".join(LADDER)
    )
    parser.add_argument(
        "--processes", default="1", help="comma list, e.g. 1,2: adds scaling rows with the fastest configuration"
    )
    parser.add_argument(
        "--output-dir", default="bench", help="where bench.json, bench.md, bench.png go (default: %(default)s)"
    )
    parser.add_argument("--report-to", choices=("none", "wandb"), default="none", help="also log the table to W&B")
    return parser


def _processes(text: str) -> list[int]:
    """``--processes 1,2`` -> [1, 2]; anything else, or more processes than :func:`most_processes`, is a ConfigError
    (torchrun would start them all, each row after the whole ladder had run)."""
    from acceltrain.config.options import ConfigError

    try:
        processes = [int(part) for part in text.split(",")]
    except ValueError:
        processes = [0]
    if min(processes) < 1:
        raise ConfigError(f"--processes {text!r} is invalid: a comma list of integers >= 1, e.g. 1,2")
    if max(processes) > 1:
        most, unit = most_processes()
        if max(processes) > most:
            raise ConfigError(
                f"--processes {text!r} asks for {max(processes)} processes: this machine runs at most "
                f"{most} (one per {unit})"
            )
    return processes


def most_processes() -> tuple[int, str]:
    """How many processes a scaling row can run here, and per what: one per GPU under CUDA (torchrun gives each
    process a device of its own), else one per CPU core this process may use (more gloo processes than cores
    share them: the row would measure the sharing, not the scaling)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count(), "GPU"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cores or 1, "CPU core"


# Steady step times vary by about 10% from step to step on a quiet machine (resnet_tiny on 2 CPU cores:
# 34-45 ms), so a mean over n timed steps is good to about 10%/sqrt(n): 20 steps give ~2%, below the
# 5-10% effects the ladder compares; 3 steps give ~6%, as large as the effects. A busy machine is worse.
MIN_STABLE_STEPS = 20


def main(argv: list[str] | None = None) -> int:
    from acceltrain.config.options import ConfigError

    parser = build_parser()
    try:
        args, args.recipe_args = parser.parse_known_args(argv)
        args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
        unknown = [r for r in args.rows if r not in LADDER]
        processes = _processes(args.processes)
        if unknown:
            raise ConfigError(f"--rows {','.join(unknown)!r} is invalid: choose from {', '.join(LADDER)}")
        if not (Path(args.recipe).is_file() if is_script(args.recipe) else module_exists(args.recipe)):
            raise ConfigError(
                f"--recipe {args.recipe!r} not found: give a recipe script's path or an installed module "
                f"such as {DEFAULT_RECIPE}"
            )
        if min(args.steps, args.batch_size) < 1 or args.warmup < 0:
            raise ConfigError("--steps and --batch-size must be >= 1, --warmup >= 0")
        check_recipe_arguments(recipe_config_class(args.recipe), args, parser, Path(args.output_dir))
        out = make_output_dir(args.output_dir)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.steps < MIN_STABLE_STEPS:
        logging.getLogger(__name__).warning(  # the plain logger: the bench itself runs no Accelerate state
            f"--steps {args.steps} is too few for a stable figure: a mean over n steps is good to about "
            f"10%/sqrt(n) on a quiet machine; use --steps {MIN_STABLE_STEPS} or more"
        )
    import torch

    load_before = os.getloadavg()
    args.on_cuda = torch.cuda.is_available()
    mixed_precision = "bf16" if (not args.on_cuda or torch.cuda.is_bf16_supported()) else "fp16"
    machine = machine_description(args.on_cuda)

    rows = run_ladder(ladder_steps(args, mixed_precision), args, out, mixed_precision)
    ran = [r for r in rows if r.status == "ok"]
    best = max(ran, key=lambda r: r.figures["samples_per_second"], default=None)
    for count in (p for p in processes if p > 1 and best is not None):
        scaling = Row(f"{best.name}, DDP", best.flags, processes=count, reference=best.figures["samples_per_second"])
        run_row(scaling, args, out, len(rows))
        rows.append(scaling)
        print(f"{scaling.name} x{count}: {scaling.status}", flush=True)

    load = {"before": load_before, "after": os.getloadavg(), "cores": os.cpu_count()}
    table = (
        render(rows, machine) + f"\n\nLoad average (1, 5, 15 min) on {load['cores']} cores: {_loads(load['before'])} "
        f"before, {_loads(load['after'])} after (a load near the core count before the bench: other work shared the "
        "machine)."
    )
    print(table)
    (out / "bench.md").write_text(table + "\n")
    (out / "bench.json").write_text(
        json.dumps(
            {
                "machine": machine,
                "model": args.model,
                "dataset": args.dataset,
                "steps": args.steps,
                "warmup": args.warmup,
                "load_average": load,
                "rows": [r.__dict__ for r in rows],
            },
            indent=2,
        )
    )
    title = f"acceltrain bench: {args.model} on {args.dataset}, {args.steps} timed steps per row\n{machine}"
    note = plot(rows, out / "bench.png", title)
    if note:
        print(note)
    if args.report_to == "wandb":
        import wandb

        run = wandb.init(project=os.environ.get("WANDB_PROJECT", "acceltrain"), job_type="bench", dir=str(out))
        columns = ["configuration", "processes", "status", "samples_per_second", "ms_per_step", "peak_memory_mb", "mfu"]
        data = [[r.name, r.processes, r.status, *(r.figures.get(c) for c in columns[3:])] for r in rows]
        run.log({"bench": wandb.Table(columns=columns, data=data)})
        run.finish()
    print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}" + ("" if note else f", {out / 'bench.png'}"))
    return 0
