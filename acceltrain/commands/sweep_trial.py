"""One trial of ``acceltrain sweep`` as its own launch: the recipe in a child process (plain python, or ``accelerate
launch --config_file``), the sweep's stop signals passed on to it once, and what its exit means for the study."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

from acceltrain.commands.recipe_loading import die_with_parent
from acceltrain.runtime.preemption import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_PREEMPTED


class Stopper:
    """SIGTERM, SIGUSR1 and Ctrl-C to the sweep: the running trial gets one SIGTERM (it checkpoints at its next step
    boundary and exits 75, as any run does) and the sweep exits 75 once it has. The trial runs in its own session, so
    that a Ctrl-C typed in the terminal reaches it only this way (a second SIGINT would abort it unsaved); a scheduler
    that signals every process (SLURM) gives it a second SIGTERM, which changes nothing."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self):
        self.received: int | None = None
        self.process: subprocess.Popen | None = None
        self._previous: dict = {}

    def install(self) -> Stopper:
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
            self.forward()

    def forward(self) -> None:
        process = self.process
        if self.received is not None and process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)  # the launcher and its workers alike


@dataclasses.dataclass
class Ended:
    """How a trial's launch ended: its exit code, its last ``error: ...`` line, whether the sweep stopped it."""

    returncode: int
    error_line: str | None
    stopped: bool

    @property
    def to_resume(self) -> bool:
        """Stopped with a checkpoint (or before it started): the trial stays running in the study, to be resumed."""
        return self.returncode != 0 and (self.stopped or self.returncode in (EXIT_PREEMPTED, EXIT_INTERRUPTED))

    @property
    def bad_input(self) -> bool:
        """Exit 2 with its one line; under ``accelerate launch`` the launcher's exit 1 with the worker's line."""
        return self.returncode == EXIT_BAD_INPUT or (self.returncode != 0 and self.error_line is not None)


def launch(argv: list[str], env: dict[str, str], stopper: Stopper, echo: bool = True) -> tuple[Ended, str]:
    """Run ``argv`` to its end: stdout passes through, stderr too (``echo``) while its ``error:`` lines are kept.
    Returns how it ended and the whole stderr."""
    process = subprocess.Popen(
        argv,
        env=env,
        stderr=subprocess.PIPE,
        stdout=None if echo else subprocess.DEVNULL,
        text=True,
        errors="replace",
        start_new_session=True,
        preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,  # noqa: PLW1509 - no threads here
    )
    stopper.process = process
    stopper.forward()  # a signal that came while it started
    error_line, lines = None, []
    for line in process.stderr:
        lines.append(line)
        if echo:
            sys.stderr.write(line)
            sys.stderr.flush()
        if line.startswith("error: "):
            error_line = line.strip()
    returncode = process.wait()
    stopper.process = None
    return Ended(returncode, error_line, stopper.received is not None), "".join(lines)


def outcome(ended: Ended, summary: dict | None, metric: str) -> tuple[str, float | None, str | None]:
    """What to tell the study of a launch that ran to its end: ("complete", value, None), ("pruned", None, None) or
    ("failed", None, the one line)."""
    if ended.returncode != 0:
        line = ended.error_line or f"error: the trial exited with code {ended.returncode}"
        return "failed", None, line.removeprefix("error: ")
    if summary is None:
        return "failed", None, "the trial exited 0 without a summary.json"
    if summary.get("stop_reason") == "pruned":
        return "pruned", None, None
    value = summary.get(metric)
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return "failed", None, f"{metric} is {value} in the trial's summary.json: no value to compare"
    return "complete", float(value), None


def names_a_swept_flag(line: str, flags: list[str]) -> bool:
    """A bad-input line that names a swept flag is that trial's own (a batch too large for the data), not every
    trial's."""
    return any(flag in line for flag in flags)


def child_env(spec: dict) -> dict[str, str]:
    import json

    from acceltrain.hooks.pruning import SWEEP_ENV

    return {**os.environ, SWEEP_ENV: json.dumps(spec)}


def last_error(stderr: str) -> str | None:
    lines = [line.strip() for line in stderr.splitlines() if line.startswith("error: ")]
    return lines[-1] if lines else None


def has_checkpoint(folder: Path) -> bool:
    return any((folder / "checkpoints").glob("step_*"))
