"""Honest numbers: throughput that excludes warm-up and evaluation and reads the clock only after the
device has finished its queued work; peak memory; the metrics.jsonl event log."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels, so that a clock read afterwards covers them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu":
        backend = getattr(torch, device.type, None)
        if backend is not None and hasattr(backend, "synchronize"):
            backend.synchronize()


class Throughput:
    """Samples and seconds of training only, counted from the end of the first ``warmup_steps``
    optimizer steps. ``pause``/``resume`` bracket evaluation; ``window_rate`` gives samples/s since
    its previous call (for log lines), ``rate`` the steady-state figure for the summary."""

    def __init__(self, device: torch.device, warmup_steps: int):
        self.device = device
        self.warmup_steps = warmup_steps
        self.samples = 0
        self.seconds = 0.0
        self.timed_steps = 0
        self._window_samples = 0
        self._window_seconds = 0.0
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
        self.seconds += elapsed
        self._window_seconds += elapsed
        self._running_since = None

    def resume(self, step: int) -> None:
        if step >= self.warmup_steps:
            self.start()

    def step_done(self, step: int, samples: int) -> None:
        """Call after optimizer step ``step`` (1-based) that consumed ``samples`` samples on all processes."""
        if step > self.warmup_steps:
            self.samples += samples
            self._window_samples += samples
            self.timed_steps += 1
        elif step == self.warmup_steps:
            self.start()

    def window_rate(self) -> float | None:
        was_timing = self.timing
        self.pause()
        rate = self._window_samples / self._window_seconds if self._window_samples and self._window_seconds > 0 else None
        self._window_samples, self._window_seconds = 0, 0.0
        if was_timing:
            self.start()
        return rate

    def rate(self) -> float | None:
        self.pause()
        return self.samples / self.seconds if self.seconds > 0 and self.samples else None


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
    about to be replayed), so every step appears once."""

    def __init__(self, path: Path | None, keep_until_step: int = 0):
        self._file = None
        if path is None:
            return
        if path.exists():
            kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= keep_until_step]
            path.write_text("".join(line + "\n" for line in kept))
        self._file = open(path, "a", buffering=1)

    def write(self, event: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(event) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
