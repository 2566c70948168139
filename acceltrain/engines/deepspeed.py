"""DeepSpeed (ZeRO stages 0-3): its engine partitions the optimizer state (and, at stage 3, the weights) and writes
its own checkpoints. One source of truth for its JSON: every setting the toolkit owns comes from the flags."""

from __future__ import annotations

import os

from accelerate.utils import DistributedType

from acceltrain.accelerate_compat import MODEL_NAME
from acceltrain.config.options import ConfigError, parse_json, read_small_file, shorten
from acceltrain.config.train_config import TrainConfig
from acceltrain.engines.base import ENGINE, Engine, Part


class DeepSpeed(Engine):
    name = "DeepSpeed"
    checkpoint_format = "DeepSpeed"
    distributed_types = (DistributedType.DEEPSPEED,)
    launch_variable = "ACCELERATE_USE_DEEPSPEED"
    takes_cpu_flag = False  # Accelerate drops DeepSpeed under cpu=True; DeepSpeed picks its own CPU accelerator
    keeps_weight_matrices = False
    refusals = {
        "async_checkpoint": (
            "--async-checkpoint works under DDP and FSDP; DeepSpeed writes its checkpoints itself: drop the flag"
        ),
        "summed_losses": (
            "a task returning (loss sum, target count) needs the gradients in param.grad to normalise them, and "
            "DeepSpeed keeps them in its partitions: use DDP or FSDP for this recipe"
        ),
        "lora": (
            "LoRA (--lora-r) is not supported under DeepSpeed here: its engine keeps the trainable weights in its "
            "own partitions; use DDP"
        ),
        "lookahead": (
            "Lookahead rewrites the weights between steps, and DeepSpeed's optimizer would overwrite them "
            "from its own copy: use DDP or one process"
        ),
    }

    @classmethod
    def start(cls, cfg, **kwargs) -> Engine:
        return super().start(cfg, deepspeed_plugin=deepspeed_plugin(cfg), **kwargs)

    def settings(self) -> dict:
        return {"deepspeed_config": self.accelerator.state.deepspeed_plugin.deepspeed_config}

    def holds_whole_weights(self) -> bool:
        return self.accelerator.state.deepspeed_plugin.zero_stage != 3

    def checkpoint_parts(self, model, optimizer, frozen: frozenset[str]) -> list[Part]:
        return [Part(MODEL_NAME, lambda folder: model.save_checkpoint(str(folder), MODEL_NAME), ENGINE)]

    def load_parts(self, folder, model, optimizer, *, strict: bool = True) -> None:
        """DeepSpeed's engine reads back its own checkpoint: the model, its optimizer partitions and loss scaler."""
        model.load_checkpoint(str(folder), MODEL_NAME)

    def writes_own_files(self) -> bool:
        return True

    @classmethod
    def merged_weights(cls, checkpoint, out) -> dict:
        raise ConfigError(
            f"checkpoint {str(checkpoint)!r} holds DeepSpeed state: DeepSpeed's zero_to_fp32.py in that folder merges "
            "it"
        )

    def relayout_refusal(self, saved_processes: int, current_processes: int) -> str | None:
        if saved_processes == current_processes:
            return None
        return (
            f"holds DeepSpeed ZeRO state partitioned over {saved_processes} processes and this run has "
            f"{current_processes}: resume on {saved_processes} processes (or convert it with DeepSpeed's "
            "ds_to_universal.py and load it with its universal-checkpoint support, outside acceltrain; a run trained "
            "under DDP or FSDP resumes on another process count)"
        )


_DEEPSPEED_OWNED = {
    "train_micro_batch_size_per_gpu": "--batch-size",
    "gradient_accumulation_steps": "--grad-accum",
    "train_batch_size": "--batch-size x --grad-accum x processes",
    "gradient_clipping": "--max-grad-norm",
}


def deepspeed_plugin(cfg: TrainConfig):
    """The DeepSpeed plugin on :func:`deepspeed_config`'s JSON; None when the launch is not a DeepSpeed one."""
    config = deepspeed_config(cfg)
    if config is None:
        return None
    from accelerate.utils import DeepSpeedPlugin

    return DeepSpeedPlugin(
        hf_ds_config=config,
        gradient_accumulation_steps=cfg.grad_accum,
        gradient_clipping=cfg.max_grad_norm or 0.0,
        zero3_init_flag=os.environ.get("ACCELERATE_DEEPSPEED_ZERO3_INIT", "false").lower() == "true",
    )


def deepspeed_config(cfg: TrainConfig) -> dict | None:
    """The DeepSpeed JSON of a DeepSpeed launch, resolved from the toolkit config: every ``"auto"`` the toolkit
    owns is filled (micro batch, accumulation, global batch, clipping, bf16/fp16), and a JSON value that
    contradicts the toolkit config is a one-line error naming both, before Accelerate resolves anything
    its own way (accelerate#2210, #2298). A JSON that is not an object, a section that is not one or a ZeRO stage
    outside 0-3 is one line too, where DeepSpeed would raise an AttributeError or ValidationError on rank 0 only.
    None when the launch is not a DeepSpeed one."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() != "true":
        return None
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if path == "none":
        raise ConfigError(
            "the accelerate config asks for DeepSpeed without deepspeed_config_file: use "
            "accelerate_configs/deepspeed_zero{2,3}.yaml"
        )
    try:
        config = parse_json(read_small_file(path, "DeepSpeed config"))
    except ValueError as err:
        raise ConfigError(f"DeepSpeed config {path!r} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ConfigError(
            f"DeepSpeed config {path!r} must be a JSON object of setting: value, not a {type(config).__name__}"
        )
    stage = _section(config, "zero_optimization", path).get("stage", "auto")
    if stage != "auto" and (type(stage) is not int or not 0 <= stage <= 3):
        raise ConfigError(
            f"DeepSpeed config {path!r}: zero_optimization.stage {shorten(stage)} is invalid: must be 0, 1, 2 or 3 "
            '(the ZeRO stage) or "auto"'
        )
    for section in ("optimizer", "scheduler"):
        if section in config:
            raise ConfigError(
                f"DeepSpeed config {path!r} defines an {section}: acceltrain builds it from the flags; remove that "
                "section"
            )
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    wanted = {
        "train_micro_batch_size_per_gpu": cfg.batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "train_batch_size": cfg.batch_size * cfg.grad_accum * processes,
        "gradient_clipping": cfg.max_grad_norm or 0.0,
    }
    for key, value in wanted.items():
        current = config.get(key, "auto")
        if current != "auto" and not _same_number(current, value):
            raise ConfigError(
                f"DeepSpeed config {path!r} sets {key}={shorten(current)} but {_DEEPSPEED_OWNED[key]} gives {value}: "
                'set it to "auto" or make them agree'
            )
        config[key] = value
    precision = cfg.mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    for name in ("bf16", "fp16"):
        enabled = _section(config, name, path).get("enabled", "auto")
        if enabled != "auto" and bool(enabled) != (precision == name):
            raise ConfigError(
                f"DeepSpeed config {path!r} sets {name}.enabled={shorten(enabled)} but --mixed-precision is "
                f'{precision}: set it to "auto" or make them agree'
            )
        config.setdefault(name, {})["enabled"] = precision == name
    return config


def _section(config: dict, name: str, path: str) -> dict:
    """``config[name]``, a JSON object ({} when absent): DeepSpeed's pydantic models and our ``.get`` take no other."""
    value = config.get(name, {})
    if not isinstance(value, dict):
        raise ConfigError(
            f"DeepSpeed config {path!r}: {name} {shorten(value)} is invalid: must be a JSON object {{...}}"
        )
    return value


def _same_number(given, wanted) -> bool:
    """Whether a JSON value equals the toolkit's number; a word or a list never does."""
    try:
        return float(given) == float(wanted)
    except (TypeError, ValueError):
        return False
