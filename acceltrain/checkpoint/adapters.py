"""Checkpoints of an adapter run (LoRA through peft) hold its trainable weights alone: the frozen base is the
pretrained folder the run starts from, which a resume loads again (a 7B base would otherwise be 14 GB a checkpoint
for MBs of adapter). Under FSDP the shards hold everything (DCP writes the whole sharded state)."""

from __future__ import annotations

from pathlib import Path

from acceltrain.checkpoint.state import CheckpointError
from acceltrain.runtime.run_folder import WEIGHTS_FILE


def frozen_names(accelerator, model) -> frozenset[str]:
    """The state-dict names of a peft model's frozen parameters (tied names too), as the unwrapped model has them."""
    from acceltrain.hf.lora import is_peft_model

    plain = accelerator.unwrap_model(model)
    if not is_peft_model(plain):
        return frozenset()
    return frozenset(name for name, param in plain.named_parameters(remove_duplicate=False) if not param.requires_grad)


def describe(frozen: frozenset[str]) -> str | None:
    """The start-up note for the log, or None for a run that checkpoints every weight."""
    if not frozen:
        return None
    return (
        f"checkpoints hold the adapter's trainable weights; the {len(frozen)} frozen base tensors come from the "
        "pretrained folder"
    )


def strict_load(accelerator, model, frozen: frozenset[str], checkpoint: Path) -> bool:
    """Whether ``checkpoint``'s weights load strictly: not when it holds exactly this adapter run's trainable weights
    (the frozen base is loaded already); every weight, or FSDP's shards, do. Weights of another model are one line."""
    from safetensors import safe_open

    file = checkpoint / WEIGHTS_FILE  # the weights of a DDP or one-process checkpoint
    if not frozen or not file.is_file():
        return True
    with safe_open(str(file), "pt") as weights:
        saved = set(weights.keys())
    names = set(accelerator.unwrap_model(model).state_dict())
    if saved == names:
        return True
    if saved == names - frozen:
        return False
    raise CheckpointError(
        f"checkpoint {str(checkpoint)!r} holds other weights than this adapter run's "
        f"({len(saved ^ (names - frozen))} names differ): resume with the same base model and LoRA settings"
    )
