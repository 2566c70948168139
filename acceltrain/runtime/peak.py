"""The device's peak FLOP/s, measured: what MFU is a fraction of where no datasheet figure is known (a CPU), and beside
it where one is (a GPU, whose datasheet peak no training run reaches).

A short matmul calibration in the run's dtype, on a given shape (a run's: its model's largest dense layer,
:func:`acceltrain.train.speed.matmul_shape`), timed with the device synchronised: rounds of at least 25 ms each, until 5
rounds bring no gain of 1%, 40 rounds, or another round would pass the time budget (5 s). The best round is the peak.
It is cached per machine, device, torch version, thread count, dtype and shape in
``$ACCELTRAIN_CACHE/peak_flops.json`` (default ``~/.cache/acceltrain``), so that a machine calibrates each shape
once."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

ROWS, MIN_SIDE, DEFAULT_SIDE = 2048, 256, 1024
ROUND_SECONDS, PATIENCE, MAX_ROUNDS, BUDGET_SECONDS = 0.025, 5, 40, 5.0
CACHE_FILE = "peak_flops.json"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # any other precision: float32


def measured_peak_flops(
    device: torch.device, precision: str, shape: tuple[int, int, int], *, clock=time.perf_counter, measure=None
) -> float:
    """The device's peak FLOP/s for ``precision`` on a matmul of ``shape``: from the cache, else calibrated (at most
    :data:`BUDGET_SECONDS`) and cached. ``measure``: the calibration (tests give their own)."""
    dtype = DTYPES.get(precision, torch.float32)
    key = _cache_key(device, dtype, shape)
    cache = _cache_path()
    known = _read(cache)
    if key in known:
        return known[key]
    flops = (measure or _calibrate)(device, dtype, shape, clock)
    _write(cache, {**_read(cache), key: flops})
    return flops


def forget_peak(device: torch.device, precision: str, shape: tuple[int, int, int]) -> None:
    """Drop a cached peak that a run went faster than (calibrated while the machine was busy): the next run
    calibrates again."""
    cache = _cache_path()
    known = _read(cache)
    if known.pop(_cache_key(device, DTYPES.get(precision, torch.float32), shape), None) is not None:
        _write(cache, known)


def _calibrate(device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int], clock) -> float:
    from acceltrain.runtime.metrics import synchronize

    rows, inputs, outputs = shape
    a = torch.randn(rows, inputs, device=device).to(dtype)
    b = torch.randn(inputs, outputs, device=device).to(dtype)
    work = 2.0 * rows * inputs * outputs
    started = clock()
    repeats, best, stale = 1, 0.0, 0
    for _ in range(MAX_ROUNDS):
        synchronize(device)
        begun = clock()
        for _ in range(repeats):
            torch.mm(a, b)
        synchronize(device)
        seconds = clock() - begun
        if seconds < ROUND_SECONDS:  # too short to time: a longer round (the warm-up too)
            repeats = max(repeats * 2, int(repeats * ROUND_SECONDS / max(seconds, 1e-9)))
            if clock() - started > BUDGET_SECONDS:
                break
            continue
        rate = work * repeats / seconds
        stale = 0 if rate > best * 1.01 else stale + 1
        best = max(best, rate)
        if stale >= PATIENCE or clock() - started + seconds > BUDGET_SECONDS:  # another round would pass the budget
            break
    return best


def _cache_key(device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int]) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"
    dtype_name, shape_name = str(dtype).removeprefix("torch."), "x".join(map(str, shape))
    return f"{platform.node()} | {device.type}: {name} | torch {torch.__version__} | {dtype_name} | {shape_name}"


def _cache_path() -> Path:
    return Path(os.environ.get("ACCELTRAIN_CACHE") or Path.home() / ".cache" / "acceltrain") / CACHE_FILE


def _read(path: Path) -> dict[str, float]:
    """The cached figures; an unreadable or edited cache counts as empty (it is only a cache)."""
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(known, dict):
        return {}
    return {key: value for key, value in known.items() if isinstance(value, (int, float)) and value > 0}


def _write(path: Path, known: dict[str, float]) -> None:
    """Atomically (a concurrent run reads the old or the new file, never half of one); a cache that cannot be written
    only costs the next run a calibration."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_text(json.dumps(known, indent=1, sort_keys=True))
        partial.replace(path)
    except OSError:
        pass
