"""How much accuracy does a fixed CPU wall-clock budget buy on the real CIFAR-10, with the best flags
against the defaults?

Both legs train ``resnet_tiny`` through recipes/resnet_cifar.py on the CIFAR-10 JPEGs
(``../shared/datasets/cifar10-jpeg.tar.gz``, extracted once into benchmarks/.data; skipped when absent):

  baseline  the recipe's defaults: fp32, DataLoader path, batch 128, lr 0.1, cosine;
  tuned     channels_last, ``--data-on-device``, batch 256, linear decay from lr 0.4 after a 15% warm-up,
            label smoothing 0.1 (see TUNED), and bf16 autocast only where it is faster: CPUs differ (with
            AVX-512 BF16 or AMX bf16 wins; without, it was 10x slower here), so a short synthetic-data
            probe of each precision picks it, and both rates are reported.

Each leg first runs a short probe (its own throughput and the cost of one evaluation), then picks
``--max-steps`` so that training plus ``--evals`` evaluations fit ``--budget-minutes`` less a 25% margin
of the run's ``wall_seconds`` (from the first step, evaluation included; process start-up, listing the files and the
one-off JPEG decode of ``--data-on-device``, cached afterwards, are outside the budget and reported
apart). Reported per leg: the best eval accuracy reached, the final one, and the time to 80% accuracy
(the eval event's ``wall_seconds`` where the loop logs it; otherwise estimated from the run's first-step
time, steady ms/step and mean evaluation time). The headline is the ratio tuned/baseline of the best
accuracies reached within the budget; an evaluation that lands past it is reported but never counted.

    python benchmarks/convergence_cpu.py                       # 10-minute budget per leg (about 25 min in all)
    python benchmarks/convergence_cpu.py --budget-minutes 1    # smoke run
"""

from __future__ import annotations

import argparse
import math
import shlex
import tempfile
import time
from pathlib import Path

from common import cifar10_jpeg, run_recipe_process, start, write_result

TARGET_ACCURACY = 0.80
PROBE_STEPS, PROBE_WARMUP = 30, 10
BASELINE = ""
TUNED = "--channels-last --data-on-device --batch-size 256 --lr 0.4 --lr-schedule linear --label-smoothing 0.1"
PRECISIONS = ("no", "bf16")  # the tuned leg takes the faster on this machine
PRECISION_PROBE_STEPS, PRECISION_PROBE_WARMUP = 8, 3
# Of the budget, left unplanned: on this 2-core VM a 10-minute run went 20-25% slower than its 30-step
# probe (tuned 811 vs 1,044 samples/s, baseline 513 vs 621), so planning on the probe alone overran the
# budget by 20-28%. What lands past the budget anyway is reported, never counted in it.
MARGIN = 0.25
WARMUP_FRACTION = 0.15  # of the steps, for the tuned leg's warm-up


def run(model: str, data_dir: Path, output_dir: Path, flags: list[str], extra: list[str]) -> tuple[dict, float]:
    started = time.perf_counter()
    summary = run_recipe_process(
        output_dir,
        [
            "--dataset",
            "imagefolder",
            "--data-dir",
            str(data_dir),
            "--model",
            model,
            "--log-every",
            "50",
            *flags,
            *extra,
        ],
    )
    return summary, time.perf_counter() - started


def evaluation_seconds(summary: dict, evals: int) -> float:
    """Mean time of one evaluation: the run's wall time less its training time, per evaluation."""
    training = summary["first_step_seconds"] + (summary["steps"] - 1) * summary["ms_per_step"] / 1000
    return max(0.0, summary["wall_seconds"] - training) / max(1, evals)


def fastest_precision(model: str, tmp: Path) -> tuple[str, dict[str, float]]:
    """The --mixed-precision of PRECISIONS with the most samples/s for ``model`` at the tuned batch and
    layout, on synthetic data (the question is compute speed, not data loading)."""
    rates = {}
    for precision in PRECISIONS:
        summary = run_recipe_process(
            tmp / f"precision-{precision}",
            [
                "--dataset",
                "synthetic",
                "--model",
                model,
                "--batch-size",
                "256",
                "--channels-last",
                "--mixed-precision",
                precision,
                "--max-steps",
                str(PRECISION_PROBE_STEPS),
                "--timing-warmup-steps",
                str(PRECISION_PROBE_WARMUP),
                "--eval-every",
                "1000000",
            ],
        )
        rates[precision] = summary["samples_per_second"]
    best = max(rates, key=rates.get)
    print(
        "precision probe: "
        + ", ".join(f"{p} {r:.0f} samples/s" for p, r in rates.items())
        + f" -> --mixed-precision {best}",
        flush=True,
    )
    return best, rates


def leg(name: str, flags: list[str], data_dir: Path, tmp: Path, args: argparse.Namespace) -> dict:
    probe, _ = run(
        args.model,
        data_dir,
        tmp / f"{name}-probe",
        flags,
        ["--max-steps", str(PROBE_STEPS), "--timing-warmup-steps", str(PROBE_WARMUP)],
    )
    step_s, eval_s = probe["ms_per_step"] / 1000, evaluation_seconds(probe, 1)
    budget_s = args.budget_minutes * 60
    evals = args.evals or max(2, min(8, round(args.budget_minutes / 2)))
    evals = (
        max(1, min(evals, int(budget_s / 2 / eval_s))) if eval_s > 0 else evals
    )  # evaluation: at most half the budget
    usable_s = budget_s * (1 - MARGIN) - probe["first_step_seconds"] - evals * eval_s
    steps = max(evals, int(usable_s / step_s))
    eval_every = math.ceil(steps / evals)
    extra = ["--max-steps", str(steps), "--eval-every", str(eval_every), "--timing-warmup-steps", str(PROBE_WARMUP)]
    if "linear" in flags:
        extra += ["--warmup-steps", str(round(WARMUP_FRACTION * steps))]
    print(
        f"{name}: probe {probe['samples_per_second']:.0f} samples/s, {1000 * step_s:.0f} ms/step, one eval "
        f"{eval_s:.1f} s -> --max-steps {steps} --eval-every {eval_every}",
        flush=True,
    )
    summary, process_s = run(args.model, data_dir, tmp / name, flags, extra)

    first, step_s = summary["first_step_seconds"], summary["ms_per_step"] / 1000
    accuracy_events = [e for e in summary["events"] if "eval_accuracy" in e]
    eval_s = evaluation_seconds(summary, len(accuracy_events))
    curve = [
        {
            "step": e["step"],
            "accuracy": e["eval_accuracy"],  # the loop's own clock when its events carry it
            "elapsed_seconds": e["wall_seconds"]
            if "wall_seconds" in e
            else first + (e["step"] - 1) * step_s + (i + 1) * eval_s,
            "elapsed_measured": "wall_seconds" in e,
        }
        for i, e in enumerate(accuracy_events)
    ]
    reached = next((point for point in curve if point["accuracy"] >= TARGET_ACCURACY), None)
    in_budget = [point["accuracy"] for point in curve if point["elapsed_seconds"] <= budget_s]
    result = {
        "flags": " ".join(flags),
        "max_steps": steps,
        "eval_every": eval_every,
        "epochs": summary["epochs"],
        "samples_per_second": summary["samples_per_second"],
        "probe_samples_per_second": probe["samples_per_second"],
        "budget_seconds": budget_s,
        "wall_seconds": summary["wall_seconds"],
        "outside_budget_seconds": process_s - summary["wall_seconds"],
        "best_accuracy": max(point["accuracy"] for point in curve),
        "final_accuracy": summary["eval_accuracy"],
        "best_accuracy_within_budget": max(in_budget, default=None),
        "within_budget": summary["wall_seconds"] <= budget_s,
        "time_to_target_seconds": reached["elapsed_seconds"] if reached else None,
        "curve": curve,
    }
    to_target = f"in {result['time_to_target_seconds']:.0f} s" if reached else "not reached"
    print(
        f"{name}: {steps} steps ({result['epochs']:.2f} epochs) at {result['samples_per_second']:.0f} samples/s in "
        f"{result['wall_seconds']:.0f} s (+{result['outside_budget_seconds']:.0f} s outside the budget); best accuracy "
        f"{result['best_accuracy']:.4f}, final {result['final_accuracy']:.4f}, {TARGET_ACCURACY:.0%} {to_target}",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--budget-minutes", type=float, default=10.0, help="per leg")
    parser.add_argument(
        "--evals",
        type=int,
        default=None,
        help="evaluations per leg (default: one per 2 minutes, 2 to 8, fewer if over half the budget)",
    )
    parser.add_argument("--model", default="resnet_tiny")
    parser.add_argument("--tuned", default=TUNED, help="the tuned leg's recipe flags")
    parser.add_argument("--baseline", default=BASELINE, help="the baseline leg's recipe flags")
    args = parser.parse_args()
    info = start(
        f"convergence on CPU: {args.model} on CIFAR-10 (JPEG), {args.budget_minutes:g} min per leg, "
        f"tuned [{args.tuned}] vs baseline [{args.baseline or 'defaults'}]"
    )
    data_dir = cifar10_jpeg()
    if data_dir is None:
        return
    with tempfile.TemporaryDirectory() as tmp:
        tuned = shlex.split(args.tuned)
        precision, precision_rates = (
            fastest_precision(args.model, Path(tmp)) if "--mixed-precision" not in tuned else (None, None)
        )
        if precision is not None:
            tuned += ["--mixed-precision", precision]
        results = {
            name: leg(name, flags, data_dir, Path(tmp), args)
            for name, flags in (("tuned", tuned), ("baseline", shlex.split(args.baseline)))
        }
    tuned_best, baseline_best = (results[name]["best_accuracy_within_budget"] or 0.0 for name in ("tuned", "baseline"))
    ratio = tuned_best / baseline_best if baseline_best else math.inf
    print(
        f"best accuracy within {args.budget_minutes:g} min: tuned {tuned_best:.4f}, baseline {baseline_best:.4f}; "
        f"ratio tuned/baseline {ratio:.3f}"
    )
    write_result(
        "convergence_cpu" if args.budget_minutes >= 10 else "convergence_cpu_smoke",
        info,
        {
            "what": "best CIFAR-10 eval accuracy within a wall-clock budget, tuned flags vs defaults",
            "model": args.model,
            "budget_minutes": args.budget_minutes,
            "target_accuracy": TARGET_ACCURACY,
            "precision_probe_samples_per_second": precision_rates,
            "results": results,
            "ratio_best_accuracy": ratio,
        },
    )


if __name__ == "__main__":
    main()
