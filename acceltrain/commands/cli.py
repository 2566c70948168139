"""acceltrain: commands around the training loop. Training itself runs from a recipe script
(python recipes/resnet_cifar.py --help lists its flags); these commands report on the machine, measure
speed, run a recipe on Ray or as replica groups that heal without a restart (ft-launch), merge a checkpoint into a
loadable folder, predict with a fine-tuned one and search hyperparameters (sweep)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import sys
import typing
from collections.abc import Callable

from acceltrain.config.options import ConfigError
from acceltrain.config.parser import parse_config
from acceltrain.config.train_config import TrainConfig
from acceltrain.runtime.preemption import EXIT_BAD_INPUT, report_error, write_error_file


def run_recipe(
    main: Callable, config_class: type[TrainConfig], argv: list[str] | None = None, description: str | None = None
):
    """Parse and validate the command line into ``config_class``, seed everything, then call ``main(cfg)``.

    Bad input anywhere before training (flags, preset file, data folder, hardware) raises
    :class:`ConfigError`; it is printed as one line and the process exits with code 2, nothing written.
    A diverged run exits 3, a second Ctrl-C 130, each with one line. A stop to be resumed (exit 75, or 130 after
    a first Ctrl-C) says so in torchelastic's error file too, since a launcher reports any exit but 0 as a failure.
    """
    from acceltrain.runtime.logs import set_log_level
    from acceltrain.runtime.preemption import EXIT_DIVERGED, EXIT_INTERRUPTED, TrainingDiverged
    from acceltrain.runtime.tracking import active_trackers

    try:
        cfg = parse_config(config_class, argv, description=description)
        set_log_level(cfg.log_level)  # before anything logs, or imports a library that does
        active_trackers(cfg)  # a tracker that cannot work (W&B key rejected, unreachable) stops here, before any data
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":  # else no torch import here
            from acceltrain.engines.deepspeed import deepspeed_config

            deepspeed_config(cfg)  # a broken DeepSpeed JSON stops here, before DeepSpeed sets up the process group
        from accelerate.utils import set_seed

        set_seed(cfg.seed)
        return main(cfg)
    except ConfigError as err:
        _fail(str(err), EXIT_BAD_INPUT)
    except TrainingDiverged as err:
        _fail(str(err), EXIT_DIVERGED)
    except KeyboardInterrupt:
        _fail(
            "interrupted by a second Ctrl-C: stopped at once, without saving; the last checkpoint is kept "
            "(continue with --resume auto)",
            EXIT_INTERRUPTED,
        )
    except SystemExit as stop:
        if hasattr(stop, "message"):  # checkpointing.StoppedToResume (not imported: --help imports no torch)
            write_error_file(stop.message)
        raise


def _fail(message: str, code: int) -> typing.NoReturn:
    from acceltrain.runtime.preemption import EXIT_INTERRUPTED, give_the_main_process_time_to_print
    from acceltrain.runtime.run_folder import unlock_output_dir

    report_error(message)
    unlock_output_dir()
    _close_process_group()
    if code != EXIT_INTERRUPTED:  # a second Ctrl-C stops at once
        give_the_main_process_time_to_print()
    raise SystemExit(code) from None


def _close_process_group() -> None:
    if (
        "torch.distributed" not in sys.modules
    ):  # a config error before any training: exit without importing torch (~3 s)
        return
    from acceltrain.runtime.distributed import close_process_group

    close_process_group()


def environment_report(accelerate_config_file: str | None = None) -> dict:
    """What ``accelerate env`` reports (from its own function, so the two never disagree) and the toolkit's
    view: versions of the libraries it builds on, the training device, whether MFU can be computed
    there, and whether bf16 is worth turning on (measured, not looked up)."""
    import io
    from importlib.metadata import PackageNotFoundError, version

    import torch
    from accelerate.commands.env import env_command

    from acceltrain import __version__
    from acceltrain.engines import use_cpu

    with contextlib.redirect_stdout(io.StringIO()):  # it prints a copy-and-paste block; we print the dict
        accelerate_report = env_command(argparse.Namespace(config_file=accelerate_config_file))
    libraries = {}
    for name in (
        "transformers",
        "datasets",
        "huggingface_hub",
        "torchvision",
        "safetensors",
        "wandb",
        "deepspeed",
        "matplotlib",
    ):
        try:
            libraries[name] = version(name)
        except PackageNotFoundError:
            libraries[name] = "not installed"
    device = torch.device("cpu") if use_cpu(False) else torch.accelerator.current_accelerator()
    toolkit = {
        "version": __version__,
        "libraries": libraries,
        "training device": _device_description(device),
        "torch threads": torch.get_num_threads(),
        "peak FLOP/s for MFU": _peak_flops_description(device),
        "bf16": _bf16_verdict(device),
    }
    return {"accelerate env": accelerate_report, "acceltrain": toolkit}


def _device_description(device) -> str:
    import torch

    if device.type == "cuda":
        return f"cuda: {torch.cuda.device_count()} x {torch.cuda.get_device_name(device)}"
    if device.type == "cpu":
        from acceltrain.commands.bench import machine_description

        return f"cpu: {machine_description(on_cuda=False)}"
    return device.type


def _peak_flops_description(device) -> str:
    """The peaks behind MFU, per precision: the datasheet's where the table knows the device, and the measured one
    (on the shape of a model without dense layers, 2048 x 1024 x 1024; a run calibrates on its own model's)."""
    import torch

    from acceltrain.runtime.peak import measured_peak_flops
    from acceltrain.train.speed import datasheet_peak_flops, matmul_shape

    figures = []
    for precision, shown in (("no", "fp32"), ("bf16", "bf16")):
        if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            continue
        measured = measured_peak_flops(device, precision, matmul_shape(None))
        datasheet = datasheet_peak_flops(device, precision)
        sheet = f", datasheet {datasheet / 1e12:g}" if datasheet else ""
        figures.append(f"{shown} measured {measured / 1e12:.3g}{sheet} TFLOP/s")
    return "; ".join(figures) + " (--peak-tflops sets the one MFU uses)"


def _bf16_verdict(device) -> str:
    """bf16 autocast against fp32, timed on a matmul and a conv: a CPU without AVX-512 BF16 or AMX, or a
    GPU before Ampere, runs bf16 slower than fp32, and then --mixed-precision bf16 costs speed."""
    import torch

    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return "not supported on this GPU: use --mixed-precision fp16"
    speedups = _bf16_speedups(device)
    mean = math.prod(speedups.values()) ** (1 / len(speedups))
    figures = ", ".join(f"{op} {ratio:.2f}x" for op, ratio in speedups.items())
    if mean >= 1.0:
        return f"fast: {figures} fp32's speed (--mixed-precision bf16 pays here)"
    return f"slow: {figures} fp32's speed (keep --mixed-precision no here)"


def _bf16_speedups(device, seconds_per_case: float = 0.3) -> dict[str, float]:
    """fp32 time / bf16-autocast time of a matmul and a 3x3 conv on ``device``, each the best of repeats
    that alternate the two precisions for ``seconds_per_case`` (so others' load hits both alike; two
    cases: about a second in all)."""
    import time

    import torch

    from acceltrain.runtime.metrics import synchronize

    size, channels = (4096, 256) if device.type == "cuda" else (512, 32)
    matrix = torch.randn(size, size, device=device)
    conv = torch.nn.Conv2d(channels, channels, 3, padding=1).to(device)
    images = torch.randn(16, channels, 32, 32, device=device)
    cases = {"matmul": lambda: matrix @ matrix, "conv": lambda: conv(images)}

    def seconds(case, bf16: bool) -> float:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            synchronize(device)
            started = time.perf_counter()
            case()
            synchronize(device)
            return time.perf_counter() - started

    speedups = {}
    with torch.inference_mode():
        for name, case in cases.items():
            seconds(case, False), seconds(case, True)  # first calls: kernel selection, allocation
            best = {False: math.inf, True: math.inf}
            deadline = time.perf_counter() + seconds_per_case
            while time.perf_counter() < deadline:
                for bf16 in best:
                    best[bf16] = min(best[bf16], seconds(case, bf16))
            speedups[name] = best[False] / best[True]
    return speedups


def _print_nested(report: dict, indent: str = "") -> None:
    for key, value in report.items():
        if isinstance(value, dict):
            print(f"{indent}{key}:")
            _print_nested(value, indent + "  ")
        else:
            print(f"{indent}{key}: {value}")


def main(argv: list[str] | None = None) -> int:
    from acceltrain import __version__

    parser_class = functools.partial(argparse.ArgumentParser, allow_abbrev=False)  # --vers is a typo, not --version
    parser = parser_class(prog="acceltrain", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"acceltrain {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=parser_class)
    env = commands.add_parser(
        "env", help="what `accelerate env` reports, plus the training device, MFU and a bf16 speed probe"
    )
    env.add_argument(
        "--accelerate-config-file", help="the accelerate config file to report (default: accelerate's default one)"
    )
    commands.add_parser(
        "bench",
        help="speed ladder: fp32 -> mixed precision -> channels_last -> compile -> ... (see bench --help)",
        add_help=False,
    )
    commands.add_parser("ray", help="run a recipe on a Ray cluster through Ray Train (see ray --help)", add_help=False)
    commands.add_parser(
        "merge",
        help="a checkpoint's model (FSDP's shards merged) as a folder that loads by itself (see merge --help)",
        add_help=False,
    )
    commands.add_parser(
        "predict",
        help="a fine-tuned run folder's predictions for the rows of a file: labels and "
        "probabilities, or generated responses (see predict --help)",
        add_help=False,
    )
    commands.add_parser(
        "sweep",
        help="a hyperparameter search on Optuna: each trial a run folder, pruned early, resumed after a "
        "preemption (see sweep --help)",
        add_help=False,
    )
    commands.add_parser(
        "ft-launch",
        help="a recipe as N replica groups on torchft: a dead group is restarted and heals from a live peer while "
        "the others go on (see ft-launch --help)",
        add_help=False,
    )
    args, rest = parser.parse_known_args(argv)
    if args.command == "ft-launch":
        from acceltrain.commands.ft_launch import main as ft_launch_main

        return ft_launch_main(rest)
    if args.command == "sweep":
        from acceltrain.commands.sweep import main as sweep_main

        return sweep_main(rest)
    if args.command == "predict":
        from acceltrain.commands.predict import main as predict_main

        try:
            return predict_main(rest)
        finally:  # its processes joined one group under accelerate launch: none is left alive at the exit
            _close_process_group()
    if args.command == "merge":
        from acceltrain.commands.merge import main as merge_main

        return merge_main(rest)
    if args.command == "bench":
        from acceltrain.commands.bench import main as bench_main

        return bench_main(rest)
    if args.command == "ray":
        from acceltrain.commands.ray_train import main as ray_main

        return ray_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    _print_nested(environment_report(args.accelerate_config_file))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
