"""``acceltrain ray``: a recipe, unchanged, on a Ray cluster through Ray Train's ``TorchTrainer``.

Ray starts one worker per process and forms the torch process group (gloo on CPUs, NCCL with
``--use-gpu``); each worker runs the recipe script as ``python RECIPE ARGS`` would, so Accelerate finds
the group Ray made and ``fit()`` runs as under ``accelerate launch``. Workers run with ``--resume auto``
(unless ``--resume`` is given): when a worker dies, Ray restarts the group (``--max-failures``) and the
run continues from the newest complete checkpoint in ``--output-dir``, which must be storage every
worker reaches (one machine, or a shared file system). Published checkpoints and the final summary are
reported to Ray (``ray.train.report``) by the :class:`RayReport` hook.

Bad input is one line and exit 2, once: the launcher's flags, the recipe's flags (parsed here as the workers will,
before Ray starts), an ``--address`` where no cluster answers (checked before ``ray.init``, which would retry it
for minutes), and bad input a worker finds (a batch larger than the data): that worker's line, not a failure Ray
restarts ``--max-failures`` times."""

from __future__ import annotations

import argparse
import json
import os
import runpy
import socket
import sys
import tempfile
import uuid
from pathlib import Path

from acceltrain.config.options import ConfigError, first_line
from acceltrain.runtime.preemption import EXIT_BAD_INPUT


def _recipe_argv(argv: list[str]) -> list[str]:
    """The recipe's flags as every worker runs them: with ``--resume auto`` unless ``--resume`` is given, so that a
    restarted worker group continues from the newest checkpoint."""
    if any(arg == "--resume" or arg.startswith("--resume=") for arg in argv):
        return list(argv)
    return [*argv, "--resume", "auto"]


def _worker(config: dict) -> None:
    """One Ray Train worker: the recipe as ``python RECIPE ARGS``. Bad input found here (exit 2) is recorded in
    Ray's key-value store, the recipe's line with it, and the worker returns without raising: raising would make
    Ray run the same bad input again ``--max-failures`` times. An attempt that finds the record (a worker that
    failed after another's bad input, restarted) returns at once. Any other exit is a failure Ray restarts."""
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_put

    from acceltrain.hooks.ray_report import RayReport

    RayReport.in_worker = True  # builtin_hooks adds it
    if _internal_kv_get(config["bad_input_key"]):
        return
    os.chdir(config["cwd"])
    sys.argv = [config["recipe"], *config["argv"]]
    with tempfile.TemporaryDirectory() as folder:
        error_file = os.environ["TORCHELASTIC_ERROR_FILE"] = os.path.join(folder, "error.json")  # run_recipe's line
        try:
            runpy.run_path(config["recipe"], run_name="__main__")
        except SystemExit as stop:
            if stop.code == EXIT_BAD_INPUT:
                _internal_kv_put(config["bad_input_key"], _bad_input_line(error_file, config["recipe"]))
            elif stop.code not in (0, None):
                raise RuntimeError(f"{Path(config['recipe']).name} exited with code {stop.code}") from None
        finally:
            os.environ.pop("TORCHELASTIC_ERROR_FILE", None)


def _bad_input_line(error_file: str, recipe: str) -> str:
    """The recipe's own ``error: ...`` line, from the error file run_recipe writes for launchers; what is known
    when the recipe exited 2 without one."""
    try:
        return json.loads(Path(error_file).read_text())["message"]["message"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"error: {Path(recipe).name} exited with code 2 (bad input: its output above says which)"


def build_parser() -> argparse.ArgumentParser:
    """Bad flags raise ConfigError (one line); an abbreviation is refused as the recipes refuse one (--num-w is a
    typo); --num-workers is checked by :func:`_check`, so that a mistyped flag is named before a missing one."""
    from acceltrain.config.parser import OneLineParser

    parser = OneLineParser(
        prog="acceltrain ray",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--num-workers", type=int, help="training processes (one per GPU with --use-gpu); required")
    parser.add_argument("--use-gpu", action="store_true", help="one GPU per worker, NCCL (default: CPU workers, gloo)")
    parser.add_argument(
        "--address", default=None, help="the Ray cluster to join ('auto': the running one); default: a local one"
    )
    parser.add_argument(
        "--max-failures", type=int, default=0, help="restarts after a worker dies, each resuming the newest checkpoint"
    )
    parser.add_argument(
        "--storage-path", default=None, help="where Ray keeps its run records and reported checkpoints (default: Ray's)"
    )
    parser.add_argument("recipe", help="the recipe script, e.g. recipes/resnet_cifar.py")
    parser.add_argument("recipe_args", nargs=argparse.REMAINDER, help="the recipe's own flags")
    return parser


def main(argv: list[str] | None = None) -> int:
    from acceltrain.commands.recipe_loading import unrecognized_arguments

    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            raise unrecognized_arguments(
                unknown,
                parser,
                [],
                "acceltrain ray's flags go before the recipe, the recipe's after it: acceltrain ray --help",
            )
        _check(args)
        import ray

        from acceltrain.commands.recipe_loading import recipe_config_class
        from acceltrain.config.parser import parse_config

        recipe_argv = _recipe_argv(args.recipe_args)
        parse_config(recipe_config_class(args.recipe, "recipe"), recipe_argv)  # the recipe's line, as a worker's
        _check_address(args.address)
        ray.init(address=args.address, include_dashboard=False)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ImportError:
        print("error: acceltrain ray needs Ray Train: pip install 'acceltrain[ray]'", file=sys.stderr)
        return 2
    except ConnectionError as err:  # an address that answered, but no Ray cluster behind it; 'auto' with none running
        print(f"error: {_no_cluster(args.address, args.address, err)}", file=sys.stderr)
        return 2
    from ray.experimental.internal_kv import _internal_kv_get
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    bad_input_key = f"acceltrain-ray-bad-input-{uuid.uuid4().hex}"
    trainer = TorchTrainer(
        _worker,
        train_loop_config={
            "recipe": str(Path(args.recipe).resolve()),
            "argv": recipe_argv,
            "cwd": os.getcwd(),
            "bad_input_key": bad_input_key,
        },
        scaling_config=ScalingConfig(
            num_workers=args.num_workers, use_gpu=args.use_gpu, resources_per_worker={"CPU": 1}
        ),
        torch_config=TorchConfig(backend="nccl" if args.use_gpu else "gloo"),
        run_config=RunConfig(
            name=Path(args.recipe).stem,
            storage_path=args.storage_path,
            failure_config=FailureConfig(max_failures=args.max_failures),
        ),
    )
    failure = None
    try:
        trainer.fit()
    except ray.train.TrainingFailedError as err:
        failure = f"error: the Ray run failed after {args.max_failures} restarts: {first_line(err)}"
    finally:
        bad_input = _internal_kv_get(bad_input_key)
        ray.shutdown()
    # printed after ray.shutdown: the last line, after the workers' output Ray forwards
    if bad_input:
        print(bad_input.decode(), file=sys.stderr)
        return 2
    if failure:
        print(failure, file=sys.stderr)
        return 1
    return 0


ADDRESS_TIMEOUT_S = 10.0


def _check_address(address: str | None) -> None:
    """A cluster ``--address`` must accept a TCP connection before ``ray.init``, which retries one where nothing
    listens for minutes without a line. Checked where Ray will connect (it takes 127.0.0.1 as this node's own
    address): the GCS port, or for ``ray://`` the Ray Client server. None and 'auto' are Ray's to find (RAY_ADDRESS,
    the last ``ray start``): a ConnectionError from ``ray.init`` when it finds none."""
    if address in (None, "auto", "local"):
        return
    from ray._private.services import canonicalize_bootstrap_address

    target = address.removeprefix("ray://")
    try:
        if target == address:
            target = canonicalize_bootstrap_address(address)
        host, _, port = target.rpartition(":")
        with socket.create_connection((host.strip("[]"), int(port)), timeout=ADDRESS_TIMEOUT_S):
            pass
    except (ValueError, OSError) as err:
        raise _no_cluster(address, target, err) from None


def _no_cluster(address: str | None, target: str | None, reason: Exception) -> ConfigError:
    """The one line for an address without a cluster, found before ``ray.init`` or by it (exit 2: the address is
    input, known before anything starts)."""
    return ConfigError(
        f"--address {address!r}: no Ray cluster answered at {target} ({first_line(reason)}); give a running "
        "cluster's host:port (`ray start --head` prints it), 'auto' for the one started on this machine, "
        "or leave --address out for a local one"
    )


def _check(args) -> None:
    if args.num_workers is None:
        raise ConfigError(
            "--num-workers is required: how many training processes Ray starts (one per GPU with --use-gpu)"
        )
    if args.num_workers < 1:
        raise ConfigError(f"--num-workers {args.num_workers}: it must be an integer >= 1")
    if args.max_failures < 0:
        raise ConfigError(f"--max-failures {args.max_failures}: it must be an integer >= 0")
    if not Path(args.recipe).is_file():
        raise ConfigError(f"recipe {args.recipe!r} is not a file")
