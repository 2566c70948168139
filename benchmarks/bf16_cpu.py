"""Does ``--mixed-precision bf16`` pay on this CPU? (issue 46, item 3)

Fine-tuning as recipes/causal_lm.py does it on benchmarks/packing.py's SFT rows (consecutive tinyshakespeare speeches,
prompt and response, 32-512 tokens; its 2,048-token BPE) with ``--packing``, a Llama of ``--hidden-size`` and
``--layers`` built there: fp32 (``--mixed-precision no``) against bf16 autocast (``--mixed-precision bf16``: fp32
weights and optimizer, bf16 matmuls, which AMX or AVX-512 BF16 run natively), for the same ``--steps`` from the same
weights and seed, in fresh processes, alternating which goes first each round. The figure is summary.json's
``real_tokens_per_second`` (from the end of step 2; the machine's peak calibration, cached per dtype and shape, and the
start-up are outside it); the ratio bf16/fp32 per round, median reported, and the eval loss of both legs (a short run:
a check that bf16 trains, not a convergence figure). The CPU's bf16 flags (``amx_bf16``, ``avx512_bf16``) are recorded.

    python benchmarks/bf16_cpu.py --hidden-size 512 --layers 8 --rounds 3   # -> benchmarks/results/bf16_cpu.json
    python benchmarks/bf16_cpu.py --hidden-size 32 --layers 2 --rounds 3    # the tests' tiny Llama: its own entry
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from common import RESULTS_DIR, cpu_bf16_flags, median, run_recipe_process, start, write_result
from packing import RECIPE, build

LEGS = {"fp32": "no", "bf16": "bf16"}  # leg -> --mixed-precision


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run (the first 2 not timed)")
    parser.add_argument("--batch-size", type=int, default=2, help="packed rows of 512 tokens per batch")
    parser.add_argument("--rows", type=int, default=256, help="training rows (enough for --steps batches)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM  # after the parser: --help answers at once

    flags = cpu_bf16_flags()
    info = start(
        f"bf16 vs fp32 on CPU: causal_lm --packing SFT, Llama width {args.hidden_size}, {args.layers} layers, "
        f"{args.steps} steps of {args.batch_size} rows of 512, {args.rounds} rounds; CPU bf16 flags: "
        f"{', '.join(flags) or 'none'}"
    )
    runs = {leg: [] for leg in LEGS}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, train, evals, lengths = build(Path(tmp), args.rows, 32, 0, args.hidden_size, args.layers)
        parameters = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
        common_args = [
            *["--model-name-or-path", str(model_dir), "--train-file", str(train), "--eval-file", str(evals)],
            *["--packing", "--block-size", "512", "--batch-size", str(args.batch_size)],
            *["--max-steps", str(args.steps), "--lr", str(args.lr), "--seed", "0", "--num-workers", "0"],
            *["--num-proc", "1", "--no-plots", "--log-every", "10", "--timing-warmup-steps", "2"],
        ]
        for round_number in range(args.rounds):
            order = list(LEGS) if round_number % 2 == 0 else list(reversed(LEGS))
            for leg in order:
                summary = run_recipe_process(
                    Path(tmp) / leg, [*common_args, "--mixed-precision", LEGS[leg]], recipe=RECIPE
                )
                figures = {key: summary[key] for key in ("real_tokens_per_second", "eval_loss", "steps", "mfu")}
                runs[leg].append(figures)
                print(f"round {round_number + 1} {leg}: {figures}", flush=True)
    ratios = [
        b["real_tokens_per_second"] / f["real_tokens_per_second"]
        for b, f in zip(runs["bf16"], runs["fp32"], strict=True)
    ]
    result = {
        "real_tokens_per_second": {
            leg: median([r["real_tokens_per_second"] for r in legs]) for leg, legs in runs.items()
        },
        "bf16_over_fp32": {"median": median(ratios), "min": min(ratios), "max": max(ratios), "values": ratios},
        "eval_loss": {leg: median([r["eval_loss"] for r in legs]) for leg, legs in runs.items()},
    }
    print(
        f"bf16 / fp32 real tokens/s: {result['bf16_over_fp32']['median']:.2f}x "
        f"({', '.join(f'{r:.2f}' for r in ratios)}); medians {result['real_tokens_per_second']['bf16']:.0f} vs "
        f"{result['real_tokens_per_second']['fp32']:.0f}; eval loss after {args.steps} steps "
        f"{result['eval_loss']['bf16']:.4f} vs {result['eval_loss']['fp32']:.4f}"
    )
    earlier = RESULTS_DIR / "bf16_cpu.json"
    models = json.loads(earlier.read_text())["models"] if earlier.is_file() else {}
    models[f"llama-w{args.hidden_size}-l{args.layers}"] = {
        "command": "python benchmarks/bf16_cpu.py " + " ".join(sys.argv[1:]),
        "args": vars(args),
        "machine": info,
        "cpu_bf16_flags": flags,
        "parameters": parameters,
        "lengths": lengths,
        "runs": runs,
        **result,
    }
    write_result("bf16_cpu", info, {"models": models})


if __name__ == "__main__":
    main()
