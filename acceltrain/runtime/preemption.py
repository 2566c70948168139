"""How a run stops early and what its exit code says: the signals schedulers send before they kill a job
(SIGTERM, SIGUSR1) and Ctrl-C, each turned into a checkpoint at the next optimizer-step boundary and an exit the
launcher can act on (75: relaunch with ``--resume auto``), and a diverged run's exit."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import threading
from pathlib import Path

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on a signal after saving; relaunch with --resume auto
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report death by SIGINT: saved on the first, at once on the second
EXIT_BAD_INPUT = 2  # one line on stderr: nothing trained, nothing written
EXIT_DIVERGED = 3  # a non-finite loss or gradient norm: nothing saved from that step on


@dataclasses.dataclass
class Stop:
    """Why the run ends early. ``finish``: as a finished run (weights, summary, exit 0), e.g. a target
    reached; otherwise checkpointed to be resumed, exiting with ``exit_code`` (75, or 130 after Ctrl-C)."""

    reason: str
    finish: bool = False
    exit_code: int = EXIT_PREEMPTED


class StoppedToResume(SystemExit):
    """The exit of a run that checkpointed to be resumed (75, or 130 after a first Ctrl-C); ``message`` says
    where and why, for the launcher's report (torchelastic's error file)."""

    def __init__(self, code: int, step: int, reason: str):
        super().__init__(code)
        self.message = f"stopped at step {step} to be resumed ({reason}); continue with --resume auto"


class TrainingDiverged(Exception):
    """A non-finite loss or gradient norm: the run stops without saving anything from that step on."""


class PreemptionSignals:
    """SIGTERM and SIGUSR1 (what schedulers send before killing a job) and a first SIGINT (Ctrl-C) set a flag
    that the loop reads at the next optimizer-step boundary; a second SIGTERM only sets it again, so a save
    in progress finishes, while a second Ctrl-C raises KeyboardInterrupt: the way to abort at once."""

    SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1", "SIGINT") if hasattr(signal, name))

    def __init__(self):
        self.received: int | None = None
        self._previous = {}

    def install(self) -> PreemptionSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    @property
    def name(self) -> str | None:
        return signal.Signals(self.received).name if self.received is not None else None

    @property
    def exit_code(self) -> int:
        return EXIT_INTERRUPTED if self.received == signal.SIGINT else EXIT_PREEMPTED

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def ignore_further(self) -> None:
        """On the way out after a stop: ignore more SIGTERM/SIGUSR1. A Python handler would be reset to the
        default (kill) during interpreter shutdown, turning a clean exit 75 into death by SIGTERM."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                if sig != signal.SIGINT:
                    signal.signal(sig, signal.SIG_IGN)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def ignore_stop_signals(worker_id: int = 0) -> None:
    """A DataLoader worker's ``worker_init_fn``: leave SIGTERM, SIGUSR1 and SIGINT to the main process. A
    signal sent to the whole process group (SLURM, ``scancel``, ``docker stop``, Ctrl-C) would otherwise kill
    the workers first and crash the run before it can save."""
    for sig in PreemptionSignals.SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def report_error(message: str) -> None:
    """One line on stderr, from one process only when several run the same recipe, and in the launcher's report."""
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {message}", file=sys.stderr, flush=True)
    write_error_file(f"error: {message}")


MAIN_PROCESS_GRACE_SECONDS = 5.0


def give_the_main_process_time_to_print() -> None:
    """A launcher stops every process as soon as one exits. Only the main process prints the line, and it can be a
    moment behind the others (the same bad flag fails everywhere), so the others wait for it before exiting: the
    launcher's SIGTERM ends the wait once the main process has printed and left (the default action again: the
    loop's preemption handler, still installed after a divergence, would only note it)."""
    if os.environ.get("RANK", "0") != "0":
        import signal
        import time

        with contextlib.suppress(ValueError):  # not the main thread: signals are not ours to set
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            time.sleep(MAIN_PROCESS_GRACE_SECONDS)
        except KeyboardInterrupt:  # Ctrl-C in the wait: leave with the one line already given
            pass


def write_error_file(message: str) -> None:
    """Under torchrun (and ``accelerate launch`` on several processes, or with DeepSpeed) ``message`` goes into the
    worker's error file, which the launcher's failure report shows as the root cause instead of "To enable
    traceback see ...". Written by hand in the format of torch's ``ErrorHandler.record_exception``, which takes
    an exception and prints its type's name: no torch import for a config error (~3 s), no "SystemExit: 75"."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        import json
        import time

        report = {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}
        try:
            Path(error_file).write_text(json.dumps({"message": report}))
        except OSError:
            pass  # the launcher reports the exit code alone
