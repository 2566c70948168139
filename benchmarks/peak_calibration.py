"""How stable the measured peak behind MFU is (issue 46 item 2): the calibration run ROUNDS times afresh (no cache) per
dtype, on the shape `acceltrain env` uses and on two model-sized ones, with the spread (max / min - 1) of each.

    python benchmarks/peak_calibration.py [--rounds 5]

The spread bound the docs quote (at most 10% on an idle machine) is this script's figure; a busy machine (other work on
its cores) spreads more, and the load average is recorded with the result."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import machine, write_result

from acceltrain.runtime import peak

SHAPES = {
    "acceltrain env": (2048, 1024, 1024),
    "resnet_tiny head-sized": (2048, 256, 256),
    "GPT-2 MLP": (2048, 768, 3072),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = {}
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for shape_name, shape in SHAPES.items():
            started = time.perf_counter()
            figures = [peak._calibrate(device, dtype, shape, time.perf_counter) for _ in range(rounds)]
            spread = max(figures) / min(figures) - 1
            results[f"{dtype_name} {shape_name} {'x'.join(map(str, shape))}"] = {
                "gflops": [round(f / 1e9, 2) for f in figures],
                "median_gflops": round(statistics.median(figures) / 1e9, 2),
                "spread": round(spread, 4),
                "seconds_per_calibration": round((time.perf_counter() - started) / rounds, 2),
            }
            print(
                f"{dtype_name:5} {shape_name:24} median {statistics.median(figures) / 1e9:8.1f} GFLOP/s, spread "
                f"{spread:6.1%}, {(time.perf_counter() - started) / rounds:.2f} s each"
            )
    write_result("peak_calibration", machine(), results)


if __name__ == "__main__":
    main()
