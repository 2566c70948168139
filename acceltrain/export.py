"""The run's final weights, written into its folder once training has finished: one place that decides what a
finished run folder holds of the model (``model.safetensors`` today)."""

from __future__ import annotations

from pathlib import Path

from .checkpointing import WEIGHTS_FILE


def export_weights(accelerator, model, output_dir: Path, weights: dict | None = None) -> Path:
    """Final full weights, loadable by the plain model: ``Accelerator.get_state_dict`` gathers DeepSpeed
    ZeRO-3 / FSDP shards and unwraps DDP and compilation (no ``module.``/``_orig_mod.`` prefix). Written
    by hand rather than with ``save_model``, which drops every tensor that shares storage with another
    as an "alias" (a logger warning only), and ZeRO-3's gathered weights are views of one flat buffer."""
    from safetensors.torch import save_file

    state_dict = accelerator.get_state_dict(model) if weights is None else weights
    path = output_dir / WEIGHTS_FILE
    if accelerator.is_main_process:
        tensors = {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in state_dict.items()}
        save_file(tensors, str(path), metadata={"format": "pt"})
    accelerator.wait_for_everyone()
    return path
