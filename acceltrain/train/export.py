"""The run's final weights, written into its folder once training has finished: one place that decides what a
finished run folder holds of the model, in the form its ecosystem loads.

- A PEFT model: the adapter folder (``adapter_config.json``, ``adapter_model.safetensors``: peft's
  ``save_pretrained``), or with ``--merge-lora`` the base model with the adapter merged in, written as below.
- A Transformers model: ``save_pretrained`` (``model.safetensors`` under the names ``from_pretrained`` reads,
  ``config.json``, ``generation_config.json``), once its weights are known to load into the model its own
  config builds; else a ConfigError, the weights kept as ``model.safetensors`` without a config.
- Any other module: ``model.safetensors`` under the plain module's names.
"""

from __future__ import annotations

from pathlib import Path

from acceltrain.config.options import ConfigError
from acceltrain.runtime.run_folder import ADAPTER_WEIGHTS_FILE, WEIGHTS_FILE


def export_weights(accelerator, model, output_dir: Path, weights: dict | None = None) -> Path:
    """Final full weights, loadable by the plain model (or, for an adapter, by peft): ``Accelerator.get_state_dict``
    gathers DeepSpeed ZeRO-3 / FSDP shards and unwraps DDP and compilation (no ``module.``/``_orig_mod.``
    prefix); ``weights`` replaces them when a hook asked to export others (``run.request_export``). Returns the
    weights file; every process calls it."""
    from acceltrain.hf.lora import is_peft_model, merge_requested

    state_dict = accelerator.get_state_dict(model) if weights is None else weights
    plain = accelerator.unwrap_model(model)
    adapter = is_peft_model(plain) and not merge_requested(plain)
    path = output_dir / (ADAPTER_WEIGHTS_FILE if adapter else WEIGHTS_FILE)
    failure = [None]  # a weights file refused on the main process fails every process alike
    if accelerator.is_main_process:
        try:
            _write(plain, state_dict, weights, output_dir, adapter)
        except ConfigError as err:
            failure = [str(err)]
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(failure, from_process=0)
    accelerator.wait_for_everyone()
    if failure[0] is not None:
        raise ConfigError(failure[0])
    return path


def _write(plain, state_dict: dict, weights: dict | None, output_dir: Path, adapter: bool) -> None:
    from acceltrain.hf.hub import check_fits_own_config, is_transformers_model
    from acceltrain.hf.lora import is_peft_model, merged

    if adapter:
        plain.save_pretrained(output_dir, state_dict=state_dict)
        return
    if is_peft_model(plain):
        plain = merged(plain, weights)
        state_dict = plain.state_dict()
    tensors = _on_cpu(state_dict)
    if not is_transformers_model(plain):
        save_tensors(tensors, output_dir)
        return
    try:
        check_fits_own_config(plain, {name: tuple(tensor.shape) for name, tensor in tensors.items()})
    except ConfigError as err:  # the trained weights are kept, under names no config claims to load
        save_tensors(tensors, output_dir)
        raise ConfigError(
            f"{err}; the trained weights are kept in {output_dir / WEIGHTS_FILE}, without a config.json"
        ) from None
    plain.save_pretrained(output_dir, state_dict=tensors)


def _on_cpu(state_dict: dict) -> dict:
    """Each tensor as its own contiguous CPU copy. Safetensors writers drop all but one of the tensors that share
    storage, taking them for aliases, and ZeRO-3's gathered weights are all views of one flat buffer: copied,
    only the weights a model ties (saved under each of their names) share nothing either."""
    return {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in state_dict.items()}


def save_tensors(tensors: dict, output_dir: Path) -> None:
    """Written by hand rather than with ``save_model``, which silently drops every tensor that shares storage
    with another as an "alias" (a logger warning only)."""
    from safetensors.torch import save_file

    save_file(tensors, str(output_dir / WEIGHTS_FILE), metadata={"format": "pt"})
