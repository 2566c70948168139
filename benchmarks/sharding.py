"""What does FSDP2 save over DDP, and --async-checkpoint over synchronous saves? A Llama-style model of at least
100M parameters (``causal_lm --model llama-small`` with a 21,528-token BPE of tinyshakespeare: 101.5M), AdamW,
trained on 2 processes through the shipped configs, each leg in fresh processes:

  (a) per-process peak memory while training (the largest ``peak_rss_mb`` of the main process in the training
      log, saves included; the final export, which gathers the whole model on the main process, comes after)
      under FSDP2 (``fsdp_cpu.yaml``) against DDP (``multi_cpu.yaml``, the same processes and batch);
  (b) steady step time, the same legs (``ms_per_step``: warm-up excluded, evaluation and saves excluded);
  (c) the seconds a save blocked training (the log's ``checkpoint_seconds`` rows: the saves during training, one
      every ``--save-every`` steps; with ``--async-checkpoint`` under DDP also the optimizer steps' waits for the
      copy that overlaps them, ``summary.json``'s ``checkpoint_wait_seconds``, shared among those saves) with
      ``--async-checkpoint`` against without, under each engine.

Targets: (a) FSDP/DDP <= 0.6; (c) async/sync <= 0.2. Legs alternate round by round (this VM's speed drifts);
medians of the rounds are reported.

    python benchmarks/sharding.py [--rounds 2] [--steps 12] [--save-every 4]   # -> benchmarks/results/sharding.json
    python benchmarks/sharding.py --quick                    # plumbing only (llama-tiny): sharding_quick.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import REPO, machine_line, median, quiet_env, start, verdict, write_result

TEXT = REPO.parent / "shared" / "datasets" / "tinyshakespeare.txt"
MEMORY_TARGET, BLOCKING_TARGET = 0.6, 0.2
ENGINES = {"ddp": "multi_cpu.yaml", "fsdp": "fsdp_cpu.yaml"}
# glibc keeps freed blocks below its (growing) mmap threshold in its heaps, per thread, so the resident set would
# count memory freed long ago (the checkpoint writers' threads make it worse): blocks from 64 KiB up are mapped and
# given back when freed, so that the peak resident set follows the live tensors, in both legs alike
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def leg(engine: str, asynchronous: bool, out: Path, args: list[str]) -> dict:
    """One launch of the LM recipe on 2 processes; its summary.json."""
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "accelerate_configs" / ENGINES[engine]),
        str(REPO / "recipes" / "causal_lm.py"),
        *args,
        "--output-dir",
        str(out),
        "--overwrite",
        "--report-to",
        "none",
        "--no-progress",
        *(["--async-checkpoint"] if asynchronous else []),
    ]
    done = subprocess.run(command, cwd=REPO, env={**quiet_env(), **MALLOC}, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{engine} leg failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    log = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    saves = [row["checkpoint_seconds"] for row in log if "checkpoint_seconds" in row]
    row = {
        "engine": engine,
        "async": asynchronous,
        "peak_rss_mb": max(row["peak_rss_mb"] for row in log if "peak_rss_mb" in row),
        "peak_rss_mb_with_export": summary["peak_rss_mb"],
        "ms_per_step": summary.get("ms_per_step"),
        "save_seconds": (sum(saves) + summary.get("checkpoint_wait_seconds", 0.0)) / len(saves) if saves else None,
        "copy_wait_seconds": summary.get("checkpoint_wait_seconds"),
        "saves_during_training": saves,
        "checkpoint_seconds": summary["checkpoint_seconds"],
        "parameters": summary["runtime"]["parameters"],
        "parameters_per_process": summary["runtime"]["parameters_per_process"],
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of the four legs (default: 2)")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per leg (default: 12)")
    parser.add_argument(
        "--save-every",
        type=int,
        default=4,
        help="a save every N steps: a writer in flight longer than N "
        "steps makes the next save wait for it (default: 4)",
    )
    parser.add_argument("--quick", action="store_true", help="llama-tiny, 4 steps, one round: checks the plumbing only")
    args = parser.parse_args()
    if not TEXT.is_file():
        parser.error(f"{TEXT} is absent: the benchmark trains on tinyshakespeare from ../shared")
    info = start("sharding: FSDP2 vs DDP memory and step time, async vs sync checkpoint blocking, 2 CPU processes")
    model, vocab, steps, every, rounds = (
        ("llama-tiny", "2000", 4, 2, 1)
        if args.quick
        else ("llama-small", "24000", args.steps, args.save_every, args.rounds)
    )
    work = Path(tempfile.mkdtemp(prefix="acceltrain-sharding-"))
    base = [
        "--model",
        model,
        "--text-files",
        str(TEXT),
        "--block-size",
        "256",
        "--batch-size",
        "2",
        "--max-steps",
        str(steps),
        "--save-every-steps",
        str(every),
        "--keep-last",
        "1",
        "--eval-fraction",
        "0.002",
        "--timing-warmup-steps",
        "1",
        "--log-every",
        "1",
        "--num-workers",
        "0",
        "--optimizer",
        "adamw",
        "--lr",
        "3e-4",
    ]
    tokenizer = work / "tokenizer"  # trained once (vocabulary 24,000 asked, 21,528 made), then given to every leg
    leg("ddp", False, tokenizer, [*base, "--vocab-size", vocab, "--max-steps", "1"])
    base += ["--tokenizer", str(tokenizer / "tokenizer.json")]
    rows = []
    for _ in range(rounds):
        for engine in ENGINES:
            for asynchronous in (False, True):
                rows.append(leg(engine, asynchronous, work / f"{engine}-{asynchronous}", base))

    def med(engine: str, asynchronous: bool, key: str) -> float:
        return median([row[key] for row in rows if row["engine"] == engine and row["async"] == asynchronous])

    memory = med("fsdp", False, "peak_rss_mb") / med("ddp", False, "peak_rss_mb")
    step_time = med("fsdp", False, "ms_per_step") / med("ddp", False, "ms_per_step")
    blocking = {engine: med(engine, True, "save_seconds") / med(engine, False, "save_seconds") for engine in ENGINES}
    # what the overlapped copy costs the steps it overlaps (it shares the CPU with them; the wait is counted above)
    slowdown = {engine: med(engine, True, "ms_per_step") / med(engine, False, "ms_per_step") for engine in ENGINES}
    result = {
        "model": model,
        "parameters": rows[0]["parameters"],
        "steps": steps,
        "save_every": every,
        "rounds": rounds,
        "quick": args.quick,
        "malloc": MALLOC,
        "fsdp_over_ddp_peak_memory": round(memory, 3),
        "fsdp_over_ddp_step_time": round(step_time, 3),
        "async_over_sync_save_seconds": {engine: round(ratio, 3) for engine, ratio in blocking.items()},
        "async_over_sync_step_time": {engine: round(ratio, 3) for engine, ratio in slowdown.items()},
        "medians": {
            f"{engine}{'-async' if asynchronous else ''}": {
                key: med(engine, asynchronous, key)
                for key in (
                    "peak_rss_mb",
                    "peak_rss_mb_with_export",
                    "ms_per_step",
                    "save_seconds",
                    "checkpoint_seconds",
                )
            }
            for engine in ENGINES
            for asynchronous in (False, True)
        },
        "rows": rows,
    }
    print(machine_line(info))
    print(
        f"{model}: {rows[0]['parameters'] / 1e6:.1f}M parameters, {rows[0]['parameters_per_process'] / 1e6:.1f}M held "
        "per process under DDP"
    )
    print(
        f"(a) peak memory per process while training, FSDP/DDP: {memory:.3f} "
        f"({verdict(memory, MEMORY_TARGET, at_least=False)})"
    )
    print(f"(b) step time FSDP/DDP: {step_time:.3f}")
    for engine, ratio in blocking.items():
        print(
            f"(c) {engine}: seconds a save blocked training, async/sync: {ratio:.3f} "
            f"({verdict(ratio, BLOCKING_TARGET, at_least=False)}); step time async/sync {slowdown[engine]:.3f}"
        )
    write_result("sharding_quick" if args.quick else "sharding", info, result)


if __name__ == "__main__":
    main()
