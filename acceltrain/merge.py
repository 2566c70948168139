"""``acceltrain merge CHECKPOINT OUT``: a checkpoint's model as a folder that loads by itself, ``model.safetensors``
with the run folder's ``config.json``, generation config and tokenizer files beside it (``from_pretrained(OUT)``
for a Transformers model, :func:`acceltrain.load_model` for one of the toolkit's). FSDP's DCP shards are merged on
one process, with no process group (Accelerate's ``merge_fsdp_weights``); a DDP or one-process checkpoint's weights
are taken as they are, without DDP's ``module.`` prefix. The checkpoint is verified first (manifest, and no file
that would run code), and ``OUT`` must be new or empty."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from .options import ConfigError

# what a run folder holds beside the weights for a loader: the model's config, a generative model's defaults, a tokenizer
BESIDE_WEIGHTS = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                  "chat_template.jinja")


def merge(checkpoint: Path, out: Path) -> Path:
    """Write ``out/model.safetensors`` (and the run folder's files beside it) from ``checkpoint``; returns the weights' path."""
    from safetensors.torch import load_file, save_file

    from .checkpoint.files import checkpoint_engine, verify_checkpoint
    from .checkpoint.safe_load import check_loadable_without_code
    from .run_folder import WEIGHTS_FILE

    verify_checkpoint(checkpoint)
    check_loadable_without_code(checkpoint)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"OUT {str(out)!r} exists and is not an empty folder: choose a new one")
    engine = checkpoint_engine(checkpoint)
    if engine == "DeepSpeed":
        raise ConfigError(f"checkpoint {str(checkpoint)!r} holds DeepSpeed state: DeepSpeed's zero_to_fp32.py in that folder merges it")
    shards = checkpoint / "pytorch_model_fsdp_0"
    if engine == "FSDP" and not shards.is_dir():
        raise ConfigError(f"checkpoint {str(checkpoint)!r} holds FSDP's full state dict, not DCP shards: use fsdp_state_dict_type: "
                          "SHARDED_STATE_DICT, or load it under FSDP")
    out.mkdir(parents=True, exist_ok=True)
    if engine == "FSDP":
        from accelerate.utils import merge_fsdp_weights

        merge_fsdp_weights(str(shards), str(out), safe_serialization=True)
    else:
        weights = load_file(str(checkpoint / WEIGHTS_FILE))
        save_file({name.removeprefix("module."): tensor for name, tensor in weights.items()}, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    run_folder = checkpoint.parent.parent
    for name in BESIDE_WEIGHTS:
        if (run_folder / name).is_file():
            shutil.copy2(run_folder / name, out / name)
    return out / WEIGHTS_FILE


def main(argv: list[str] | None = None) -> int:
    from .config import _OneLineParser

    parser = _OneLineParser(prog="acceltrain merge", description=__doc__, allow_abbrev=False)
    parser.add_argument("checkpoint", help="a checkpoint folder, e.g. runs/NAME/checkpoints/step_00001000")
    parser.add_argument("out", help="a new folder for model.safetensors and the run folder's config and tokenizer files")
    try:
        args = parser.parse_args(argv)
        weights = merge(Path(args.checkpoint), Path(args.out))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {weights}")
    return 0
