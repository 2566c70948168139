"""Does gradient accumulation give a 4x larger effective batch for (almost) the memory of the small one?

ResNet-18 (CIFAR stem) on synthetic CIFAR-shaped data through recipes/resnet_cifar.py, one fresh
process per configuration (peak memory is per process), no loader workers:

  (1) batch b                    the baseline
  (2) batch b, --grad-accum 4    effective batch 4b
  (3) batch 4b                   effective batch 4b the direct way, for context

Peak memory is the run's summary.json figure: ``peak_rss_mb`` on CPU (the process's peak resident set,
which also holds torch itself), ``peak_allocated_mb`` on CUDA. Each configuration runs ``--repeats``
times, alternating the order; medians are compared. Target: (2)/(1) <= 1.05.

    python benchmarks/accumulation.py [--batch-size 32] [--steps 3] [--repeats 2] \\
        # -> benchmarks/results/accumulation.json
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import median, run_recipe_process, start, verdict, write_result

TARGET = 1.05


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--batch-size", type=int, default=32, help="b")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model", default="resnet18")
    args = parser.parse_args()
    b = args.batch_size
    info = start(
        f"gradient accumulation memory: {args.model}, b={b}, {args.steps} optimizer steps, "
        f"{args.repeats} fresh processes per configuration"
    )

    configs = {
        f"batch {b}": ["--batch-size", str(b)],
        f"batch {b} x grad-accum 4": ["--batch-size", str(b), "--grad-accum", "4"],
        f"batch {4 * b}": ["--batch-size", str(4 * b)],
    }
    common_args = [
        "--dataset",
        "synthetic",
        "--model",
        args.model,
        "--max-steps",
        str(args.steps),
        "--num-workers",
        "0",
        "--timing-warmup-steps",
        "1",
        "--log-every",
        "1",
    ]
    peaks: dict[str, list[float]] = {name: [] for name in configs}
    key = None
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            names = list(configs) if repeat % 2 == 0 else list(reversed(configs))
            for name in names:
                summary = run_recipe_process(
                    Path(tmp) / f"run{len(peaks[name])}-{name.replace(' ', '_')}", [*common_args, *configs[name]]
                )
                key = "peak_allocated_mb" if "peak_allocated_mb" in summary else "peak_rss_mb"
                peaks[name].append(summary[key])
                print(
                    f"repeat {repeat + 1} {name:26} {key} {summary[key]:8.1f}  "
                    f"({summary['samples_per_second'] or 0:.1f} samples/s)",
                    flush=True,
                )

    base, accum, big = (median(peaks[name]) for name in configs)
    ratio = accum / base
    print(
        f"median {key}: batch {b}: {base:.1f}, batch {b} x 4 accumulation: {accum:.1f} ({accum - base:+.1f} MB), "
        f"batch {4 * b}: {big:.1f} ({big / base:.2f}x)"
    )
    print(
        f"ratio accumulation/batch {b}: {ratio:.3f}  ({verdict(ratio, TARGET, at_least=False)}); "
        f"batch {4 * b} alone would be {big / base:.2f}x"
    )
    write_result(
        "accumulation",
        info,
        {
            "what": f"peak memory ({key}) of effective batch 4b by --grad-accum 4 vs batch b; batch 4b for context",
            "model": args.model,
            "batch_size": b,
            "steps": args.steps,
            "memory_key": key,
            "peaks_mb": peaks,
            "median_mb": dict(zip(configs, (base, accum, big), strict=True)),
            "ratio": ratio,
            "ratio_batch_4b": big / base,
            "target": TARGET,
            "target_met": ratio <= TARGET,
        },
    )


if __name__ == "__main__":
    main()
