"""``acceltrain ray``: a recipe, unchanged, on a Ray cluster through Ray Train's ``TorchTrainer``.

Ray starts one worker per process and forms the torch process group (gloo on CPUs, NCCL with
``--use-gpu``); each worker runs the recipe script as ``python RECIPE ARGS`` would, so Accelerate finds
the group Ray made and ``fit()`` runs as under ``accelerate launch``. Workers run with ``--resume auto``
(unless ``--resume`` is given): when a worker dies, Ray restarts the group (``--max-failures``) and the
run continues from the newest complete checkpoint in ``--output-dir``, which must be storage every
worker reaches (one machine, or a shared file system). Published checkpoints and the final summary are
reported to Ray (``ray.train.report``) by the :class:`RayReport` hook."""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path

from .options import ConfigError
from .hooks.base import Hook

_IN_WORKER = False  # set in a Ray Train worker: builtin_hooks adds RayReport


def in_ray_worker() -> bool:
    return _IN_WORKER


class RayReport(Hook):
    """Each published checkpoint and the final summary go to ``ray.train.report`` (every process reports,
    as Ray Train V2 requires; the main process attaches the checkpoint folder)."""

    def on_save(self, run, folder: Path) -> None:
        import ray.train

        checkpoint = ray.train.Checkpoint.from_directory(str(folder)) if run.accelerator.is_main_process else None
        ray.train.report({"step": run.step}, checkpoint=checkpoint)

    def on_fit_end(self, run, summary: dict) -> None:
        import ray.train

        ray.train.report({k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})


def _worker(config: dict) -> None:
    global _IN_WORKER
    _IN_WORKER = True
    os.chdir(config["cwd"])
    argv = list(config["argv"])
    if not any(arg == "--resume" or arg.startswith("--resume=") for arg in argv):
        argv += ["--resume", "auto"]
    sys.argv = [config["recipe"], *argv]
    try:
        runpy.run_path(config["recipe"], run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (0, None):
            raise RuntimeError(f"{Path(config['recipe']).name} exited with code {stop.code}") from None


def build_parser() -> argparse.ArgumentParser:
    """Bad flags raise ConfigError (one line); an abbreviation is refused as the recipes refuse one (--num-w is a
    typo); --num-workers is checked by :func:`_check`, so that a mistyped flag is named before a missing one."""
    from .config import _OneLineParser

    parser = _OneLineParser(prog="acceltrain ray", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                            allow_abbrev=False)
    parser.add_argument("--num-workers", type=int, help="training processes (one per GPU with --use-gpu); required")
    parser.add_argument("--use-gpu", action="store_true", help="one GPU per worker, NCCL (default: CPU workers, gloo)")
    parser.add_argument("--address", default=None, help="the Ray cluster to join ('auto': the running one); default: a local one")
    parser.add_argument("--max-failures", type=int, default=0, help="restarts after a worker dies, each resuming the newest checkpoint")
    parser.add_argument("--storage-path", default=None, help="where Ray keeps its run records and reported checkpoints (default: Ray's)")
    parser.add_argument("recipe", help="the recipe script, e.g. recipes/resnet_cifar.py")
    parser.add_argument("recipe_args", nargs=argparse.REMAINDER, help="the recipe's own flags")
    return parser


def main(argv: list[str] | None = None) -> int:
    from .bench import unrecognized_arguments

    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            raise unrecognized_arguments(unknown, parser, [], "acceltrain ray's flags go before the recipe, the recipe's "
                                                              "after it: acceltrain ray --help")
        _check(args)
        import ray
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ImportError:
        print("error: acceltrain ray needs Ray Train: pip install 'acceltrain[ray]'", file=sys.stderr)
        return 2
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(address=args.address, include_dashboard=False)
    trainer = TorchTrainer(
        _worker,
        train_loop_config={"recipe": str(Path(args.recipe).resolve()), "argv": args.recipe_args, "cwd": os.getcwd()},
        scaling_config=ScalingConfig(num_workers=args.num_workers, use_gpu=args.use_gpu, resources_per_worker={"CPU": 1}),
        torch_config=TorchConfig(backend="nccl" if args.use_gpu else "gloo"),
        run_config=RunConfig(name=Path(args.recipe).stem, storage_path=args.storage_path,
                             failure_config=FailureConfig(max_failures=args.max_failures)),
    )
    try:
        trainer.fit()
    except ray.train.TrainingFailedError as err:
        print(f"error: the Ray run failed after {args.max_failures} restarts: {str(err).strip().splitlines()[0]}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    return 0


def _check(args) -> None:
    if args.num_workers is None:
        raise ConfigError("--num-workers is required: how many training processes Ray starts (one per GPU with --use-gpu)")
    if args.num_workers < 1:
        raise ConfigError(f"--num-workers {args.num_workers}: it must be an integer >= 1")
    if args.max_failures < 0:
        raise ConfigError(f"--max-failures {args.max_failures}: it must be an integer >= 0")
    if not Path(args.recipe).is_file():
        raise ConfigError(f"recipe {args.recipe!r} is not a file")
