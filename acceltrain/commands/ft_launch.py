"""acceltrain ft-launch: a recipe as N replica groups that heal from each other (torchft) instead of restarting.

  acceltrain ft-launch --replica-groups N [--max-restarts K] [--min-replicas R] RECIPE [RECIPE ARGS...]

It starts torchft's Lighthouse in this process and each replica group as one process of the recipe, reading its own
shard of the data. A group that dies (killed, out of memory) is started again, up to K times in all, and heals from a
live peer before its first step; the other groups go on meanwhile, averaging their gradients over the groups that
take part. Replica 0 writes the run folder and its checkpoints. When every group is gone, the same command with
--resume auto continues from the last checkpoint. SIGTERM or Ctrl-C stops every group at its next step boundary with
a checkpoint (exit 75), as a run does.

Events, one JSON object a line in RUN/ft_events.jsonl: started (pid), ready (up, about to join), quorum
(participants, at each change), healed (from_replica, seconds), finished (weights_sha256). Replica 0's output is this
command's; the other groups' is in RUN/ft_logs/replica_N.log."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from acceltrain.config.options import ConfigError
from acceltrain.runtime.preemption import EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_INTERRUPTED, EXIT_PREEMPTED

LOGS_DIR = "ft_logs"
NOT_RESTARTED = (0, EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_PREEMPTED, EXIT_INTERRUPTED)  # it ended; no heal helps


def build_parser() -> argparse.ArgumentParser:
    from acceltrain.config.parser import command_parser

    parser = command_parser("acceltrain ft-launch", __doc__)
    add = parser.add_argument
    add("--replica-groups", type=int, help="replica groups, each one process; required")
    add("--nproc-per-group", type=int, default=1, help="processes per group (1: only one process a group for now)")
    add("--max-restarts", type=int, default=3, help="restarts of dead groups in all (default 3)")
    add("--min-replicas", type=int, default=1, help="groups a step needs to commit (default 1)")
    add("--lighthouse-port", type=int, default=0, help="the Lighthouse's port (default: a free one)")
    add("--heartbeat-timeout", type=float, default=3.0, help="seconds before a silent group leaves the quorum")
    add("recipe", nargs="?", help="the recipe: a script (recipes/resnet_cifar.py) or a module")
    add("recipe_args", nargs=argparse.REMAINDER, help="the recipe's own flags")
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's own logs, here and in the groups: lines every step at INFO
    try:
        args = build_parser().parse_args(argv)
        check(args)
        launch = Launch(args)
        codes = launch.run()
        status = 0 if launch.finished() else _status(codes)
        if status == EXIT_BAD_INPUT:
            launch.leave_as_found()
        return status
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


def check(args) -> None:
    """What the launch can know is wrong before any group starts: one line each."""
    if args.replica_groups is None or args.replica_groups < 1:
        shown = "is required" if args.replica_groups is None else f"is {args.replica_groups}"
        raise ConfigError(f"--replica-groups {shown}: give the number of replica groups, at least 1")
    if args.nproc_per_group != 1:
        raise ConfigError(
            f"--nproc-per-group {args.nproc_per_group}: each replica group is one process for now (1); scale with "
            "--replica-groups"
        )
    for flag, value, low in (("--max-restarts", args.max_restarts, 0), ("--min-replicas", args.min_replicas, 1)):
        if value < low:
            raise ConfigError(f"{flag} {value}: it must be at least {low}")
    if args.min_replicas > args.replica_groups:
        raise ConfigError(
            f"--min-replicas {args.min_replicas} is more than the {args.replica_groups} --replica-groups: no step "
            "could commit"
        )
    if args.heartbeat_timeout <= 0:
        raise ConfigError(f"--heartbeat-timeout {args.heartbeat_timeout}: give a number of seconds above 0")
    if not args.recipe:
        raise ConfigError("no recipe given: acceltrain ft-launch --replica-groups N RECIPE [RECIPE ARGS...]")
    asked = [name for name in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP") if _true(os.environ.get(name))]
    if asked:
        raise ConfigError(
            f"{asked[0]}=true in the environment asks for {asked[0].split('_')[-1]}, and a torchft replica group is "
            "one process of its own: unset it"
        )
    from acceltrain.engines.torchft import require_torchft

    require_torchft()


@dataclasses.dataclass
class Group:
    replica: int
    process: subprocess.Popen | None = None
    returncode: int | None = None  # once ended for good


class Launch:
    def __init__(self, args):
        from acceltrain.runtime.run_folder import check_claimable

        self.args = args
        recipe_args, self.output_dir = _with_output_dir(args.recipe, list(args.recipe_args))
        resume = _asks_resume(recipe_args)
        # before this launch writes its events and logs there: the groups' claim would refuse it, or (--overwrite)
        # the previous run moves aside now, with nothing of this launch in it
        self.aside = check_claimable(self.output_dir, "--overwrite" in recipe_args, resume)
        if self.aside is not None:
            print(
                f"ft-launch: --overwrite: moved the previous run in {self.output_dir} to {self.aside}", file=sys.stderr
            )
        self.recipe_args = [arg for arg in recipe_args if arg != "--overwrite"]
        self.found = frozenset(os.listdir(self.output_dir)) if self.output_dir.is_dir() else None
        self.events = self.output_dir / "ft_events.jsonl"
        self.restarts_left = args.max_restarts
        self.stopping: int | None = None
        self.groups = [Group(replica) for replica in range(args.replica_groups)]

    def run(self) -> list[int]:
        """Every group to its end; their exit codes."""
        from torchft.coordination import LighthouseServer

        try:
            lighthouse = LighthouseServer(
                bind=f"[::]:{self.args.lighthouse_port}",
                min_replicas=self.args.min_replicas,
                join_timeout_ms=10_000,
                quorum_tick_ms=100,
                heartbeat_timeout_ms=int(self.args.heartbeat_timeout * 1000),
            )
        except RuntimeError as err:
            raise ConfigError(
                f"--lighthouse-port {self.args.lighthouse_port}: the Lighthouse cannot listen there: {err}"
            ) from None
        previous = {sig: signal.signal(sig, self._stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            (self.output_dir / LOGS_DIR).mkdir(parents=True, exist_ok=True)
            for group in self.groups:
                self._start(group, lighthouse.address(), restart=False)
            while any(group.returncode is None for group in self.groups):
                time.sleep(0.1)
                for group in self.groups:
                    if group.returncode is None and group.process.poll() is not None:
                        self._ended(group, lighthouse.address())
        finally:
            for group in self.groups:
                if group.returncode is None and group.process is not None:
                    _signal(group.process, signal.SIGKILL)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            lighthouse.shutdown()
        return [group.returncode for group in self.groups]

    def _start(self, group: Group, lighthouse: str, restart: bool) -> None:
        from acceltrain.commands.recipe_loading import command, die_with_parent
        from acceltrain.engines.torchft import EVENTS, GROUPS, MIN_REPLICAS, REPLICA, RESTARTED, TorchFT, record_event

        env = {key: value for key, value in os.environ.items() if key not in _PROCESS_GROUP_VARIABLES}
        env.update(
            {
                TorchFT.launch_variable: "true",
                REPLICA: str(group.replica),
                RESTARTED: "1" if restart else "0",
                GROUPS: str(len(self.groups)),
                MIN_REPLICAS: str(self.args.min_replicas),
                EVENTS: str(self.events),
                "TORCHFT_LIGHTHOUSE": lighthouse,
            }
        )
        log = None
        if group.replica:
            log = open(self.output_dir / LOGS_DIR / f"replica_{group.replica}.log", "a")  # noqa: SIM115
        args = _restart_args(self.recipe_args) if restart else self.recipe_args
        group.process = subprocess.Popen(
            command(self.args.recipe, args),
            env=env,
            stdout=log,
            stderr=log,
            start_new_session=True,  # a Ctrl-C reaches the groups once, as SIGTERM from here
            preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,  # noqa: PLW1509 - no threads
        )
        if log is not None:
            log.close()
        record_event(self.events, "started", group.replica, pid=group.process.pid, restart=restart)

    def _ended(self, group: Group, lighthouse: str) -> None:
        code = group.process.returncode
        others_failed = code in (EXIT_BAD_INPUT, EXIT_DIVERGED) and not self.finished()
        if code in NOT_RESTARTED or self.stopping is not None or self.restarts_left == 0 or self.finished():
            group.returncode = code
            if others_failed:  # the same bad input stops every group: nothing to wait for
                self._stop(signal.SIGTERM, None)
            return
        self.restarts_left -= 1
        shown = f"signal {-code}" if code < 0 else f"exit code {code}"
        print(
            f"ft-launch: replica group {group.replica} ended ({shown}); restarting it ({self.restarts_left} restarts "
            "left): it heals from a live peer",
            file=sys.stderr,
            flush=True,
        )
        self._start(group, lighthouse, restart=True)

    def leave_as_found(self) -> None:
        """The groups refused bad input before training (each removed what it added): this launch's events and logs
        go too, the folder if the launch made it, and a previous run that ``--overwrite`` moved aside comes back.
        Once anything else is there, a run trained: all of it stays."""
        from acceltrain.runtime.run_folder import remove_added

        if self.output_dir.is_dir():
            added = set(os.listdir(self.output_dir)) - (self.found or set())
            if not added <= {self.events.name, LOGS_DIR}:
                return
            remove_added(self.output_dir, self.found)
        if self.aside is not None and not self.output_dir.exists():
            os.rename(self.aside, self.output_dir)

    def finished(self) -> bool:
        """Replica 0 trained to the end and wrote the run's outputs: a group that ends later changes nothing."""
        return self.groups[0].returncode == 0

    def _stop(self, signum, frame) -> None:
        """SIGTERM or Ctrl-C: every live group stops at its next step boundary with a checkpoint; none restarts."""
        if self.stopping is not None:
            return
        self.stopping = signum
        for group in self.groups:
            if group.returncode is None and group.process is not None:
                _signal(group.process, signal.SIGTERM)


_PROCESS_GROUP_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _true(value: str | None) -> bool:
    return (value or "").lower() == "true"


def _signal(process: subprocess.Popen, sig: int) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)


def _with_output_dir(recipe: str, args: list[str]) -> tuple[list[str], Path]:
    """The recipe's arguments with an ``--output-dir`` every group shares (a run's default name has the time in
    it, which each group would read for itself), and that folder."""
    for index, arg in enumerate(args):
        if arg == "--output-dir" and index + 1 < len(args):
            return args, Path(args[index + 1])
        if arg.startswith("--output-dir="):
            return args, Path(arg.split("=", 1)[1])
    name = Path(recipe).stem if recipe.endswith(".py") else recipe.rsplit(".", 1)[-1]
    folder = Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return [*args, "--output-dir", str(folder)], folder


def _asks_resume(args: list[str]) -> bool:
    return any(arg == "--resume" or arg.startswith("--resume=") for arg in args)


def _restart_args(args: list[str]) -> list[str]:
    """A restarted group's arguments: ``--resume auto`` unless a resume is asked already (with no live peer left, it
    continues from the last checkpoint; ``--overwrite`` was done, once, by the launch)."""
    if _asks_resume(args):
        return args
    return [*args, "--resume", "auto"]


def _status(codes: list[int]) -> int:
    """The launch's exit status when replica 0 did not finish: bad input or divergence in any group (which stopped the
    others, whichever ended first), else the first group's failure (a stop: 75)."""
    failed = [code for code in codes if code]
    if not failed:
        return 0
    cause = next((code for code in failed if code in (EXIT_BAD_INPUT, EXIT_DIVERGED)), failed[0])
    return 128 - cause if cause < 0 else cause  # killed by a signal: as a shell reports it
