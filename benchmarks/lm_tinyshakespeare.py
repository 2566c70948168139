"""How far does the tiny causal-LM preset get on real text in a fixed wall-clock budget on this machine?

Data: ``../shared/datasets/tinyshakespeare.txt`` (1.1 MB of Shakespeare; skipped when absent). Model and
settings: ``recipes/configs/lm_tiny_cpu.yaml`` (GPT-2 style, 3 layers of width 128, a 2,048-token BPE,
128-token blocks), launched as a user would (``python recipes/causal_lm.py``), one process.

1. Warm-up launch (``--warmup-steps`` optimizer steps): the steady step time, the fixed cost of a launch
   (imports, tokenizer, data, saving) and the cost of one evaluation.
2. The measured launch: ``--max-steps`` chosen so that launch + steps + evaluations fit in the budget
   with a margin, so the cosine schedule reaches 0 exactly at the last step. It reuses the warm-up's
   tokenizer, so both launches see the same blocks.
3. Baselines on the same held-out blocks, computed here: a unigram model (the token frequencies of the
   training blocks, add-one smoothed: what a model that ignores context can do) and the untrained model.

Reported: eval loss (nats per token) and perplexity reached, and the ratios to the unigram baseline
(lower is better), in ``benchmarks/results/lm_tinyshakespeare.json``.

    python benchmarks/lm_tinyshakespeare.py [--budget-minutes 10]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

WORK = Path(tempfile.mkdtemp(prefix="lm_tinyshakespeare-"))
os.environ.setdefault("HF_DATASETS_CACHE", str(WORK / "hf_datasets"))  # before datasets is imported anywhere
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local

import torch  # noqa: E402
from common import REPO, run_recipe_process, start, write_result  # noqa: E402
from common import TINYSHAKESPEARE as TEXT  # noqa: E402

RECIPE = REPO / "recipes" / "causal_lm.py"
PRESET = REPO / "recipes" / "configs" / "lm_tiny_cpu.yaml"
EVALUATIONS = 6  # during the measured run, the last step's included
MARGIN = 0.08  # of the budget, left for a shared machine's noise


def timed_launch(output_dir: Path, args: list[str]) -> tuple[dict, float]:
    began = time.perf_counter()
    summary = run_recipe_process(output_dir, ["--config", str(PRESET), "--text-files", str(TEXT), *args], recipe=RECIPE)
    return summary, time.perf_counter() - began


def plan_steps(warmup: dict, launch_seconds: float, budget_seconds: float) -> tuple[int, dict]:
    """Steps that fit the budget, from the warm-up's steady step time, launch cost and evaluation cost."""
    global_batch = warmup["runtime"]["global_batch_size"]
    step_seconds = global_batch / warmup["samples_per_second"]
    fixed_seconds = launch_seconds - warmup["wall_seconds"]  # imports, tokenizer, data, saving
    # what the warm-up spent beyond its steps at the steady rate: its one evaluation (and its slow first steps)
    eval_seconds = max(0.0, warmup["wall_seconds"] - warmup["steps"] * step_seconds)
    usable = budget_seconds * (1 - MARGIN) - fixed_seconds - EVALUATIONS * eval_seconds
    steps = int(usable / step_seconds)
    if steps < 10:
        raise SystemExit(
            f"a {budget_seconds / 60:g}-minute budget leaves {steps} steps on this machine: raise --budget-minutes"
        )
    plan = {
        "step_seconds": step_seconds,
        "launch_seconds": fixed_seconds,
        "eval_seconds": eval_seconds,
        "max_steps": steps,
    }
    return steps, plan


def baselines(run_dir: Path, config: dict) -> dict:
    """Unigram and untrained-model cross-entropy (nats per predicted token) on the run's held-out blocks."""
    from accelerate.utils import set_seed

    from acceltrain.text import (
        CausalLMTask,
        build_causal_lm,
        load_text,
        show_progress_bars,
        split_blocks,
        token_blocks,
        tokenizer_for_run,
    )

    show_progress_bars(False)
    texts = load_text(str(TEXT))
    tokenizer = tokenizer_for_run(config["tokenizer"], "--tokenizer", texts, run_dir, config["vocab_size"])
    blocks = token_blocks(texts, tokenizer, block_size=config["block_size"], num_proc=config["num_proc"])
    train, held_out = split_blocks(blocks, eval_fraction=config["eval_fraction"], seed=config["seed"])
    vocab = len(tokenizer)
    train_tokens, eval_tokens = train[:]["input_ids"], held_out[:]["input_ids"]  # [blocks, block_size] tensors
    counts = torch.bincount(train_tokens.flatten(), minlength=vocab).double() + 1  # add-one smoothing
    targets = eval_tokens[:, 1:].flatten()  # the positions the model is scored on
    unigram = -(counts / counts.sum()).log()[targets].mean().item()

    set_seed(config["seed"])  # the same initial weights as the run's
    model = build_causal_lm(
        config["model"], vocab_size=vocab, block_size=config["block_size"], end_of_text_id=tokenizer.eos_token_id
    )
    task = CausalLMTask(config["block_size"], 0)
    sums = {"loss_sum": 0.0, "tokens": 0.0}
    with torch.no_grad():
        for start_row in range(0, len(held_out), 64):
            values = task.eval_values(model.eval(), {"input_ids": eval_tokens[start_row : start_row + 64]})
            sums = {key: sums[key] + values[key].sum().item() for key in sums}
    untrained = task.eval_metrics(sums, len(held_out))["loss"]
    return {
        "unigram_loss": unigram,
        "untrained_loss": untrained,
        "uniform_loss": math.log(vocab),
        "eval_blocks": len(held_out),
        "train_blocks": len(train),
        "vocab_size": vocab,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--budget-minutes", type=float, default=10.0, help="wall-clock budget of the measured launch")
    parser.add_argument(
        "--warmup-steps", type=int, default=100, help="optimizer steps of the throughput warm-up launch"
    )
    options = parser.parse_args()
    info = start(f"causal LM ({PRESET.name}) on tinyshakespeare, {options.budget_minutes:g}-minute budget")
    if not TEXT.is_file():
        shutil.rmtree(WORK, ignore_errors=True)
        print(f"skipped: {TEXT} is absent (the tinyshakespeare text; see ../shared/README.md)")
        return
    budget_seconds = options.budget_minutes * 60
    try:
        warmup_dir, run_dir = WORK / "warmup", WORK / "run"
        warmup, warmup_launch = timed_launch(
            warmup_dir, ["--max-steps", str(options.warmup_steps), "--eval-every", str(10**9)]
        )
        steps, plan = plan_steps(warmup, warmup_launch, budget_seconds)
        print(
            f"warm-up: {plan['step_seconds']:.3f} s/step, {plan['launch_seconds']:.1f} s per launch, "
            f"{plan['eval_seconds']:.1f} s per evaluation -> --max-steps {steps}",
            flush=True,
        )
        run, run_seconds = timed_launch(
            run_dir,
            [
                "--max-steps",
                str(steps),
                "--eval-every",
                str(math.ceil(steps / (EVALUATIONS - 1))),
                "--tokenizer",
                str(warmup_dir / "tokenizer.json"),
            ],
        )
        reference = baselines(run_dir, run["config"])
    finally:
        shutil.rmtree(WORK, ignore_errors=True)

    loss = run["eval_loss"]
    curve = [{"step": e["step"], "eval_loss": e["eval_loss"]} for e in run["events"] if "eval_loss" in e]
    result = {
        "command": "python benchmarks/lm_tinyshakespeare.py " + " ".join(sys.argv[1:]),
        "preset": str(PRESET.relative_to(REPO)),
        "budget_seconds": budget_seconds,
        "run_seconds": run_seconds,
        "fits_budget": run_seconds <= budget_seconds,
        "plan": plan,
        "steps": run["steps"],
        "epochs": run["epochs"],
        "tokens_seen": run["samples_seen"] * run["config"]["block_size"],
        "tokens_per_second": run.get("tokens_per_second"),
        "eval_loss": loss,
        "eval_perplexity": math.exp(loss),
        **reference,
        "loss_vs_unigram": loss / reference["unigram_loss"],
        "perplexity_vs_unigram": math.exp(loss - reference["unigram_loss"]),
        "eval_curve": curve,
    }
    print(
        f"eval loss {loss:.3f} nats/token (perplexity {math.exp(loss):.1f}) after {run['steps']} steps, "
        f"{result['tokens_seen'] / 1e6:.2f}M tokens in {run_seconds:.0f} s of a {budget_seconds:.0f} s budget"
    )
    print(
        f"unigram baseline {reference['unigram_loss']:.3f} (perplexity {math.exp(reference['unigram_loss']):.1f}), "
        f"untrained model {reference['untrained_loss']:.3f}: loss ratio {result['loss_vs_unigram']:.3f}, "
        f"perplexity ratio {result['perplexity_vs_unigram']:.3f} (lower is better)"
    )
    write_result("lm_tinyshakespeare", info, result)


if __name__ == "__main__":
    main()
