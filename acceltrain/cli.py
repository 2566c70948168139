"""Command-line entry points: ``run_recipe`` for recipe scripts and the ``acceltrain`` console script."""

from __future__ import annotations

import argparse
import os
import sys
import typing
from collections.abc import Callable
from pathlib import Path

from .config import ConfigError, TrainConfig, parse_config

EXIT_BAD_INPUT = 2


def _report_error(message: str) -> None:
    """One line on stderr, from one process only when several run the same recipe; under torchrun (and
    ``accelerate launch`` on several processes) also in the worker's error file, which the launcher's
    failure report shows as the root cause instead of "To enable traceback see ..."."""
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {message}", file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        import json
        import time

        # the format torch.distributed.elastic's ErrorHandler.record_exception writes
        report = {"message": f"error: {message}", "extraInfo": {"py_callstack": f"error: {message}", "timestamp": str(int(time.time()))}}
        try:
            Path(error_file).write_text(json.dumps({"message": report}))
        except OSError:
            pass  # the line above is already on stderr


def run_recipe(main: Callable, config_class: type[TrainConfig], argv: list[str] | None = None, description: str | None = None):
    """Parse and validate the command line into ``config_class``, seed everything, then call ``main(cfg)``.

    Bad input anywhere before training (flags, preset file, data folder, hardware) raises
    :class:`ConfigError`; it is printed as one line and the process exits with code 2, nothing written.
    A diverged run exits 3, a second Ctrl-C 130, each with one line.
    """
    from .checkpointing import EXIT_DIVERGED, EXIT_INTERRUPTED
    from .run import TrainingDiverged

    try:
        cfg = parse_config(config_class, argv, description=description)
        from accelerate.utils import set_seed

        set_seed(cfg.seed)
        return main(cfg)
    except ConfigError as err:
        _fail(str(err), EXIT_BAD_INPUT)
    except TrainingDiverged as err:
        _fail(str(err), EXIT_DIVERGED)
    except KeyboardInterrupt:
        _fail("interrupted by a second Ctrl-C: stopped at once, without saving; the last checkpoint is kept "
              "(continue with --resume auto)", EXIT_INTERRUPTED)


def _fail(message: str, code: int) -> typing.NoReturn:
    from .checkpointing import unlock_output_dir

    _report_error(message)
    unlock_output_dir()
    _close_process_group()
    raise SystemExit(code) from None


def _close_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def environment_report() -> dict:
    """What this machine offers and what Accelerate would do here."""
    import accelerate
    import torch

    from . import __version__
    from .distributed import use_cpu

    report = {
        "acceltrain": __version__,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "accelerate": accelerate.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "bf16_supported": torch.cuda.is_bf16_supported() if torch.cuda.is_available() else "cpu autocast",
        "trains_on_cpu": use_cpu(False),
        "cpu_threads": torch.get_num_threads(),
    }
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="acceltrain", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("env", help="print versions, devices and what Accelerate would use here")
    commands.add_parser("bench", help="speed ladder: fp32 -> mixed precision -> channels_last -> compile -> ... (see bench --help)", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        from .bench import main as bench_main

        return bench_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "env":
        for key, value in environment_report().items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
