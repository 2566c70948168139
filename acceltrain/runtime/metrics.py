"""Honest numbers: throughput that excludes warm-up and evaluation and reads the clock only after the
device has finished its queued work; peak memory; the metrics.jsonl event log."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch
from accelerate.logging import get_logger

from acceltrain.config.options import parse_json

logger = get_logger(__name__)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels, so that a clock read afterwards covers them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu":
        backend = getattr(torch, device.type, None)
        if backend is not None and hasattr(backend, "synchronize"):
            backend.synchronize()


class Throughput:
    """Samples, seconds and data-wait seconds of training only, counted from the end of the first
    ``warmup_steps`` optimizer steps (warm-up, allocator growth, compilation). ``pause``/``resume``
    bracket evaluation and checkpointing; ``window`` gives the figures since its previous call (for log
    lines), ``totals`` the steady-state figures of the whole run (for the summary)."""

    def __init__(self, device: torch.device, warmup_steps: int):
        self.device = device
        self.warmup_steps = warmup_steps
        self._total = _Tally()
        self._window = _Tally()
        self._running_since: float | None = None

    @property
    def timing(self) -> bool:
        return self._running_since is not None

    def start(self) -> None:
        synchronize(self.device)
        self._running_since = time.perf_counter()

    def pause(self) -> None:
        if self._running_since is None:
            return
        synchronize(self.device)
        elapsed = time.perf_counter() - self._running_since
        self._total.seconds += elapsed
        self._window.seconds += elapsed
        self._running_since = None

    def resume(self, step: int) -> None:
        if step >= self.warmup_steps:
            self.start()

    def step_done(self, step: int, samples: int) -> None:
        """Call after optimizer step ``step`` (1-based, counted in this launch) that used ``samples`` samples."""
        if step > self.warmup_steps:
            for tally in (self._total, self._window):
                tally.samples += samples
                tally.steps += 1
        elif step == self.warmup_steps:
            self.start()

    def add_data_wait(self, seconds: float) -> None:
        """Host time spent blocked on the next batch."""
        if self.timing:
            self._total.data_wait += seconds
            self._window.data_wait += seconds

    def window(self) -> dict:
        was_timing = self.timing
        self.pause()
        figures = self._window.figures()
        self._window = _Tally()
        if was_timing:
            self.start()
        return figures

    def totals(self) -> dict:
        self.pause()
        return {**self._total.figures(), "timed_steps": self._total.steps}


class _Tally:
    def __init__(self):
        self.samples, self.steps, self.seconds, self.data_wait = 0, 0, 0.0, 0.0

    def figures(self) -> dict:
        if not (self.steps and self.seconds > 0):
            return {"samples_per_second": None, "ms_per_step": None, "data_wait_fraction": None}
        return {
            "samples_per_second": self.samples / self.seconds,
            "ms_per_step": 1000 * self.seconds / self.steps,
            "data_wait_fraction": min(1.0, self.data_wait / self.seconds),
        }


def peak_memory_mb(device: torch.device) -> dict[str, float]:
    """CUDA: max allocated and max reserved by this process; CPU: this process's peak resident set."""
    if device.type == "cuda":
        return {
            "peak_allocated_mb": torch.cuda.max_memory_allocated(device) / 2**20,
            "peak_reserved_mb": torch.cuda.max_memory_reserved(device) / 2**20,
        }
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {"peak_rss_mb": peak_kb / (2**20 if sys.platform == "darwin" else 2**10)}


class EventLog:
    """Appends one JSON object per line to ``metrics.jsonl``; a no-op on non-main processes.

    A resumed run first drops the events past its checkpoint's step (logged before the interruption,
    about to be replayed), so every step appears once, and any line a crash cut short."""

    def __init__(self, path: Path | None, keep_until_step: int = 0):
        self._file = None
        if path is None:
            return
        if path.exists():
            kept, unreadable = [], 0
            for line in path.read_text().splitlines():
                try:
                    if parse_json(line)["step"] <= keep_until_step:
                        kept.append(line)
                except (ValueError, KeyError, TypeError):  # a line cut short by a crash mid-write
                    unreadable += bool(line.strip())
            if unreadable:
                logger.warning(f"{path}: dropped {unreadable} unreadable line(s), a write cut short by a crash")
            path.write_text("".join(line + "\n" for line in kept))
        self._file = open(path, "a", buffering=1)

    def write(self, event: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(event) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
