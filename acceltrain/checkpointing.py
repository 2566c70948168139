"""The run folder and what is written into it: final weights as ``model.safetensors``, ``summary.json``."""

from __future__ import annotations

import json
import time
from pathlib import Path

from .config import ConfigError, TrainConfig

SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"
WEIGHTS_FILE = "model.safetensors"


def resolve_output_dir(cfg: TrainConfig, recipe_name: str) -> Path:
    """``--output-dir``, or ``runs/<recipe>-<timestamp>`` agreed by all processes. Refuses a folder that
    already holds a finished run unless ``--overwrite``: a typo must not replace last week's results."""
    from accelerate.utils import broadcast_object_list

    if cfg.output_dir is not None:
        output_dir = Path(cfg.output_dir)
    else:
        stamp = [time.strftime("%Y%m%d-%H%M%S")]
        broadcast_object_list(stamp, from_process=0)
        output_dir = Path("runs") / f"{recipe_name}-{stamp[0]}"
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"--output-dir {str(output_dir)!r} exists and is not a directory")
    if (output_dir / SUMMARY_FILE).exists() and not cfg.overwrite:
        raise ConfigError(
            f"--output-dir {str(output_dir)!r} already holds a finished run ({SUMMARY_FILE}); "
            "pass --overwrite to replace it or choose another --output-dir"
        )
    return output_dir


def export_weights(accelerator, model, output_dir: Path) -> Path:
    """Final full weights through ``Accelerator.save_model`` (gathers DeepSpeed/FSDP shards, unwraps
    DDP and torch.compile, so keys carry no ``module.``/``_orig_mod.`` prefix)."""
    accelerator.save_model(model, output_dir, safe_serialization=True)
    return output_dir / WEIGHTS_FILE


def write_summary(output_dir: Path, summary: dict) -> None:
    (output_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, default=str) + "\n")
