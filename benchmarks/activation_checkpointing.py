"""What does ``--activation-checkpointing`` (``acceltrain.train.speed.enable_activation_checkpointing``) save
and cost on ResNet-50 with the CIFAR stem, batch 32, 32x32 inputs?

  (a) activation bytes kept for backward after one training forward: every tensor autograd saves
      (``torch.autograd.graph.saved_tensors_hooks``), parameters and buffers excluded, counted once per
      storage; with checkpointing, plus the inputs the checkpointed blocks keep alive for recomputation
      (seen by forward pre-hooks on the blocks: depending on the torch version, non-reentrant checkpoint
      holds them outside the hooks or saves them through them; the union by storage counts them once);
  (b) step time, forward + backward, after warm-up steps, the two models' steps interleaved so that a
      shared machine's noise hits both; medians reported.

Targets: (a) with/without <= 0.70 (at least 30% less); (b) with/without <= 1.35.

    python benchmarks/activation_checkpointing.py [--batch-size 32] [--steps 6] \\
        # -> benchmarks/results/activation_checkpointing.json
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F
from common import median, start, verdict, write_result
from torchvision.models.resnet import BasicBlock, Bottleneck

from acceltrain.runtime.metrics import synchronize
from acceltrain.train.speed import enable_activation_checkpointing
from acceltrain.vision import build_resnet

MEMORY_TARGET, TIME_TARGET = 0.70, 1.35
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def saved_activation_bytes(
    model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor, checkpointed: bool
) -> dict:
    """Bytes of the distinct storages one training forward keeps for backward (see the module docstring)."""
    weights = {storage_key(t) for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}  # storage -> bytes
    block_inputs: dict[int, int] = {}

    def pack(tensor: torch.Tensor):
        if storage_key(tensor) not in weights:
            saved[storage_key(tensor)] = tensor.untyped_storage().nbytes()
        return tensor

    def pre_hook(_module, args):
        for arg in args:
            if isinstance(arg, torch.Tensor):
                block_inputs[storage_key(arg)] = arg.untyped_storage().nbytes()

    hooks = []
    if checkpointed:
        hooks = [
            m.register_forward_pre_hook(pre_hook) for m in model.modules() if isinstance(m, (BasicBlock, Bottleneck))
        ]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = F.cross_entropy(model(inputs), labels)
    for hook in hooks:
        hook.remove()
    total = {**block_inputs, **saved}  # one entry per storage
    del loss  # free the graph without a backward
    return {
        "autograd_saved_bytes": sum(saved.values()),
        "checkpoint_input_bytes": sum(block_inputs.values()),
        "total_bytes": sum(total.values()),
    }


def step_seconds(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> float:
    synchronize(DEVICE)
    started = time.perf_counter()
    F.cross_entropy(model(inputs), labels).backward()
    synchronize(DEVICE)
    seconds = time.perf_counter() - started
    model.zero_grad(set_to_none=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per model")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    info = start(f"activation checkpointing: resnet50 (CIFAR stem), batch {args.batch_size}, device {DEVICE}")

    torch.manual_seed(0)
    plain = build_resnet("resnet50").to(DEVICE).train()
    checkpointed = copy.deepcopy(plain)
    note = enable_activation_checkpointing(checkpointed)
    inputs = torch.randn(args.batch_size, 3, 32, 32, device=DEVICE)
    labels = torch.randint(0, 10, (args.batch_size,), device=DEVICE)

    memory = {
        "without": saved_activation_bytes(plain, inputs, labels, checkpointed=False),
        "with": saved_activation_bytes(checkpointed, inputs, labels, checkpointed=True),
    }
    memory_ratio = memory["with"]["total_bytes"] / memory["without"]["total_bytes"]

    times = {"without": [], "with": []}
    for step in range(args.warmup + args.steps):
        for name, model in (
            (("without", plain), ("with", checkpointed))
            if step % 2 == 0
            else (("with", checkpointed), ("without", plain))
        ):
            seconds = step_seconds(model, inputs, labels)
            if step >= args.warmup:
                times[name].append(seconds)
    time_ratio = median(times["with"]) / median(times["without"])

    mb = lambda n: n / 2**20  # noqa: E731
    print(f"checkpointing: {note}")
    for name in ("without", "with"):
        m = memory[name]
        print(
            f"{name:7} checkpointing: saved activations {mb(m['total_bytes']):8.1f} MB "
            f"(autograd-saved {mb(m['autograd_saved_bytes']):.1f} MB, checkpointed-block inputs "
            f"{mb(m['checkpoint_input_bytes']):.1f} MB), step {1000 * median(times[name]):7.1f} ms (median of "
            f"{len(times[name])})"
        )
    print(
        f"saved-activation bytes with/without: {memory_ratio:.3f} ({1 - memory_ratio:.0%} less; "
        f"{verdict(memory_ratio, MEMORY_TARGET, at_least=False)})"
    )
    print(f"step time with/without: {time_ratio:.3f}x ({verdict(time_ratio, TIME_TARGET, at_least=False)})")
    write_result(
        "activation_checkpointing",
        info,
        {
            "what": (
                "activation bytes kept for backward and forward+backward step time, with/without activation "
                "checkpointing"
            ),
            "model": "resnet50 (cifar stem)",
            "device": str(DEVICE),
            "batch_size": args.batch_size,
            "checkpointing": note,
            "memory": memory,
            "memory_ratio": memory_ratio,
            "memory_target": MEMORY_TARGET,
            "memory_target_met": memory_ratio <= MEMORY_TARGET,
            "step_seconds": times,
            "time_ratio": time_ratio,
            "time_target": TIME_TARGET,
            "time_target_met": time_ratio <= TIME_TARGET,
        },
    )


if __name__ == "__main__":
    main()
