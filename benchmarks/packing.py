"""Does --packing train a length-skewed SFT file faster, to the same eval loss?

The SFT file is built from the real tinyshakespeare text (../shared/datasets/tinyshakespeare.txt): the play is cut
into speeches (a "Name:" line and the lines after it up to a blank line); each pair of consecutive speeches by two
different speakers is a row, the prompt "<speaker A>: <speech A>\\n<speaker B>:" and the response " <speech B>",
kept when the pair is 32 to 512 tokens long. Speeches are mostly a line or two and sometimes forty, so the lengths
are skewed as real SFT files are (their median and quantiles are printed). A seeded share of the rows is held out
as --eval-file, the same for both legs. The tokenizer is a 2,048-token byte-level BPE trained on the text
(acceltrain's own), and the model the tests' tiny Llama (2 layers, width 32, 2 heads), built here, 512 positions.

Each round runs recipes/causal_lm.py twice in fresh processes, unpacked (one example per sequence, padded per
batch) and --packing, alternating which goes first, for the same --epochs, batch size and learning rate; the
figures are summary.json's `real_tokens_per_second` (padding left out) and `eval_loss` (per response token; equal
on packed and unpacked eval rows, tests/test_packing.py). Ratios are packed / unpacked per round, their median
reported. Targets (issue 46): real tokens/s >= 1.8x; eval loss at most 3% above the unpacked run's.

    python benchmarks/packing.py [--rows 1024] [--epochs 2] [--rounds 3]   # -> benchmarks/results/packing.json
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import tempfile
from pathlib import Path

from common import REPO, median, run_recipe_process, start, verdict, write_result
from common import TINYSHAKESPEARE as TEXT

RECIPE = REPO / "recipes" / "causal_lm.py"
SPEAKER = re.compile(r"^([A-Z][A-Za-z ]*):$")


def speeches(text: str) -> list[tuple[str, str]]:
    """(speaker, speech) in the play's order."""
    found = []
    for block in text.split("\n\n"):
        lines = block.strip("\n").split("\n")
        if len(lines) >= 2 and (match := SPEAKER.match(lines[0])):
            found.append((match.group(1), " ".join(line.strip() for line in lines[1:])))
    return found


def sft_rows(tokenizer, low: int = 32, high: int = 512) -> list[dict]:
    """Consecutive speeches by two speakers as prompt and response, kept at ``low`` to ``high`` tokens."""
    rows, play = [], speeches(TEXT.read_text())
    for (first, said), (second, answer) in zip(play, play[1:], strict=False):
        if first == second:
            continue
        row = {"prompt": f"{first}: {said}\n{second}:", "response": f" {answer}"}
        length = len(tokenizer(row["prompt"] + row["response"])["input_ids"]) + 1
        if low <= length <= high:
            rows.append({**row, "tokens": length})
    return rows


def save_llama(model_dir: Path, tokenizer, width: int, layers: int, seed: int) -> Path:
    """A fresh Llama of ``width`` and ``layers`` for ``tokenizer`` (initialised after ``torch.manual_seed(seed)``),
    saved with the tokenizer in ``model_dir``: the tests' tiny Llama at width 32, SwiGLU's proportions above."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=width,
        intermediate_size=2 * width if width == 32 else 64 * -(-8 * width // 192),  # the tests' 64; else SwiGLU's
        num_hidden_layers=layers,
        num_attention_heads=max(2, width // 64),
        num_key_value_heads=max(2, width // 64),
        max_position_embeddings=512,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir


def build(folder: Path, rows: int, eval_rows: int, seed: int, width: int, layers: int) -> tuple[Path, Path, Path, dict]:
    """(model folder, train file, eval file, length figures)."""
    import datasets
    from transformers import PreTrainedTokenizerFast

    from acceltrain.text.corpus import END_OF_TEXT, train_byte_level_bpe

    bpe = train_byte_level_bpe(datasets.Dataset.from_dict({"text": TEXT.read_text().split("\n")}), 2048)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=END_OF_TEXT)
    model_dir = save_llama(folder / "model", tokenizer, width, layers, seed)
    pairs = sft_rows(tokenizer)
    random.Random(seed).shuffle(pairs)
    if len(pairs) < rows + eval_rows:
        raise SystemExit(f"--rows {rows}: the text gives {len(pairs)} pairs of 32 to 512 tokens")
    files = []
    for name, part in (("train", pairs[:rows]), ("eval", pairs[rows : rows + eval_rows])):
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"prompt": r["prompt"], "response": r["response"]}) + "\n" for r in part))
        files.append(path)
    lengths = sorted(row["tokens"] for row in pairs[:rows])
    figures = {
        "pairs_available": len(pairs),
        "median_tokens": statistics.median(lengths),
        "p10_tokens": lengths[len(lengths) // 10],
        "p90_tokens": lengths[9 * len(lengths) // 10],
        "max_tokens": lengths[-1],
        "mean_tokens": sum(lengths) / len(lengths),
    }
    return model_dir, files[0], files[1], figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--rows", type=int, default=1024, help="training rows")
    parser.add_argument("--eval-rows", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--packed-batch-size",
        type=int,
        help="rows per batch of the packed leg (default: --batch-size): fewer rows "
        "give it about the unpacked leg's tokens and optimizer steps per epoch",
    )
    parser.add_argument("--hidden-size", type=int, default=32, help="the tests' tiny Llama: 32")
    parser.add_argument("--layers", type=int, default=2, help="the tests' tiny Llama: 2")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    info = start(
        f"packing: Llama (width {args.hidden_size}, {args.layers} layers) SFT on tinyshakespeare speech pairs, "
        f"{args.rows} rows, {args.epochs} epochs, "
        f"batch {args.batch_size} (packed {args.packed_batch_size or args.batch_size}), --block-size 512, "
        f"{args.rounds} rounds"
    )
    packed_batch = args.packed_batch_size or args.batch_size
    legs = {"unpacked": [], "packed": ["--packing", "--batch-size", str(packed_batch)]}
    results = {leg: [] for leg in legs}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, train, evals, lengths = build(
            Path(tmp), args.rows, args.eval_rows, args.seed, args.hidden_size, args.layers
        )
        print(f"rows: {args.rows} train, {args.eval_rows} eval; tokens per row: {lengths}", flush=True)
        common_args = [
            *["--model-name-or-path", str(model_dir), "--train-file", str(train), "--eval-file", str(evals)],
            *["--block-size", "512", "--batch-size", str(args.batch_size), "--epochs", str(args.epochs)],
            *["--lr", str(args.lr), "--seed", str(args.seed), "--num-workers", "0", "--num-proc", "1"],
            *["--no-plots", "--log-every", "10", "--timing-warmup-steps", "2"],
        ]
        for round_number in range(args.rounds):
            order = list(legs) if round_number % 2 == 0 else list(reversed(legs))
            for leg in order:
                summary = run_recipe_process(Path(tmp) / leg, [*common_args, *legs[leg]], recipe=RECIPE)
                figures = {
                    key: summary[key]
                    for key in (
                        "real_tokens_per_second",
                        "real_token_share",
                        "eval_loss",
                        "steps",
                        "wall_seconds",
                        "mfu",
                    )
                }
                results[leg].append(figures)
                print(f"round {round_number + 1} {leg}: {figures}", flush=True)
    speed = [
        p["real_tokens_per_second"] / u["real_tokens_per_second"]
        for p, u in zip(results["packed"], results["unpacked"], strict=True)
    ]
    loss = [p["eval_loss"] / u["eval_loss"] for p, u in zip(results["packed"], results["unpacked"], strict=True)]
    summary = {
        "real_tokens_per_second_ratio": median(speed),
        "real_tokens_per_second_ratios": speed,
        "eval_loss_ratio": median(loss),
        "real_token_share": {leg: median([r["real_token_share"] for r in runs]) for leg, runs in results.items()},
        "eval_loss": {leg: median([r["eval_loss"] for r in runs]) for leg, runs in results.items()},
        "real_tokens_per_second": {
            leg: median([r["real_tokens_per_second"] for r in runs]) for leg, runs in results.items()
        },
    }
    print(
        f"packed / unpacked real tokens/s: {summary['real_tokens_per_second_ratio']:.2f}x (rounds: "
        f"{', '.join(f'{r:.2f}' for r in speed)}); {verdict(summary['real_tokens_per_second_ratio'], 1.8, True)}"
    )
    print(
        f"eval loss after {args.epochs} epochs: packed {summary['eval_loss']['packed']:.4f}, unpacked "
        f"{summary['eval_loss']['unpacked']:.4f} ({summary['eval_loss_ratio']:.3f}x); "
        f"{verdict(summary['eval_loss_ratio'], 1.03, False)}"
    )
    name = "packing" + (f"_width{args.hidden_size}" if args.hidden_size != 32 else "")
    name += f"_batch{args.packed_batch_size}" if args.packed_batch_size else ""
    path = write_result(name, info, {"args": vars(args), "lengths": lengths, "runs": results, "summary": summary})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
