"""A run folder's model card (``README.md``: Hub metadata, the model, its data, the settings, the final metrics, the
hardware and the command) and ``train_config.yaml`` (the settings that make the same run again), all from the run."""

from __future__ import annotations

import os
import shlex
import sys
import sysconfig
from pathlib import Path

import yaml
from torch import nn

from acceltrain.config.train_config import TrainConfig
from acceltrain.hf.hub import BUILD_ATTRIBUTE, is_transformers_model, model_head, own_class
from acceltrain.runtime.run_folder import ADAPTER_SETTINGS_FILE, TRAIN_CONFIG_FILE

# run-location settings, left out of train_config.yaml so that it starts a fresh run anywhere
NOT_REPRODUCED = (
    "config",
    "output_dir",
    "resume",
    "overwrite",
    "allow_config_change",
    "stop_after_steps",
    "push_to_hub",
    "hub_model_id",
    "hub_private",
)
KEY_SETTINGS = (
    "batch_size",
    "grad_accum",
    "optimizer",
    "lr",
    "momentum",
    "weight_decay",
    "lr_schedule",
    "warmup_steps",
    "max_grad_norm",
    "epochs",
    "max_steps",
    "seed",
)
RESULT_KEYS = (
    "train_loss",
    "steps",
    "epochs",
    "samples_seen",
    "wall_seconds",
    "samples_per_second",
    "tokens_per_second",
    "mfu",
    "time_to_target_seconds",
)


def write_train_config(cfg: TrainConfig, output_dir: Path) -> None:
    """The resolved settings as a ``--config`` preset: the same run again, in a new folder."""
    settings = {key: value for key, value in cfg.to_dict().items() if key not in NOT_REPRODUCED}
    (output_dir / TRAIN_CONFIG_FILE).write_text(yaml.safe_dump(settings, sort_keys=False))


def model_card(run, model: nn.Module, summary: dict, pipeline_tag: str | None, repo_id: str | None) -> str:
    """README.md: Hub metadata, then the model, its data, the settings, the final metrics, the hardware and
    the command, all from the run itself."""
    from huggingface_hub import ModelCardData

    from acceltrain.hf.lora import is_peft_model

    cfg, runtime, model_class = run.cfg, run.runtime, own_class(model)
    adapter, transformers_model = is_peft_model(model), is_transformers_model(model)
    build = getattr(model, BUILD_ATTRIBUTE, None)
    data = ModelCardData(
        library_name="peft" if adapter else "transformers" if transformers_model else "acceltrain",
        pipeline_tag=pipeline_tag,
        tags=["acceltrain", *(["lora"] if adapter else [])],
        base_model=getattr(cfg, "model_name_or_path", None),
        datasets=getattr(cfg, "dataset_name", None),
    )
    where = repo_id or str(run.output_dir.resolve())  # loads from anywhere, as the "same run again" line runs
    if adapter:
        made, load = _adapter_description(model, where)
    elif transformers_model:
        head = model_head(model)
        module, loader = ("transformers", head[0]) if head else (model_class.__module__, model_class.__name__)
        made = f"`{model_class.__name__}` (Transformers, `{model.config.model_type}`)"
        load = f'from {module} import {loader}\nmodel = {loader}.from_pretrained("{where}")'
    elif build is not None:
        arguments = ", ".join(f"{key}={value!r}" for key, value in build["kwargs"].items())
        made = f"`{model_class.__name__}` from `{build['builder']}({arguments})`"
        load = f'from acceltrain.hf.hub import load_model\nmodel = load_model("{where}")'
    else:
        made = (
            f"`{model_class.__name__}`, built by the recipe (no registered builder: rebuild it, then load "
            "`model.safetensors`)"
        )
        load = (
            "from safetensors.torch import load_model\n"
            f'load_model(model, "{where}/model.safetensors")  # model: the recipe\'s own'
        )
    own_fields = [f for f in type(cfg).__dataclass_fields__ if f not in TrainConfig.__dataclass_fields__]
    resolved = {**cfg.to_dict(), **cfg.resolved()}  # as the run used them (--lora-alpha unset: 2 x --lora-r)
    samples = [f"training samples: {run.train_samples or 'a stream'}"]
    if run.eval_batches is not None and hasattr(run.eval_batches, "dataset"):
        samples.append(f"evaluation samples: {len(run.eval_batches.dataset)}")
    metrics = {k: v for k, v in summary.items() if k.startswith("eval_") and v is not None}
    metrics.update({k: summary[k] for k in RESULT_KEYS if summary.get(k) is not None})
    hardware = {
        "device": runtime.get("device_name"),
        "processes": runtime.get("num_processes"),
        "distributed type": runtime.get("distributed_type"),
        "mixed precision": summary.get("mixed_precision"),
        "torch": runtime.get("torch"),
        "accelerate": runtime.get("accelerate"),
        "acceltrain": runtime.get("acceltrain"),
    }
    settings = {key: resolved[key] for key in KEY_SETTINGS} | {"global batch": runtime.get("global_batch_size")}
    script = sys.argv[0] if sys.argv and sys.argv[0] else "RECIPE.py"
    # from where it was started: the command and train_config.yaml's data paths may be relative to there
    preset = str(run.output_dir.resolve() / TRAIN_CONFIG_FILE)
    again = f"cd {shlex.quote(os.getcwd())} && {shlex.join([*launch_command(), '--config', preset])}"
    return "\n".join(
        [
            f"---\n{data.to_yaml()}\n---",
            f"# {where.rsplit('/', 1)[-1]}",
            "",
            f"Trained by the acceltrain recipe `{Path(script).name}` (one training loop on Hugging Face Accelerate).",
            "",
            "## Model",
            "",
            f"{made}, {_parameters(model, summary)}.{_weights_step(summary)} Load it with one call:",
            "",
            f"```python\n{load}\n```",
            "",
            "## Model and data settings of the recipe",
            "",
            _table({name: resolved[name] for name in own_fields}),
            "",
            *[f"- {line}" for line in samples],
            "",
            "## Training settings",
            "",
            _table(settings),
            "",
            f"Every setting: `{TRAIN_CONFIG_FILE}`; the same run again, from the folder it was started in: `{again}`.",
            "",
            "## Results",
            "",
            _table(metrics),
            "",
            "Per-step metrics: `metrics.jsonl`; the whole record: `summary.json`.",
            "",
            "## Hardware",
            "",
            _table(hardware),
            "",
            "## Command",
            "",
            f"```bash\n{shlex.join([*launch_command(), *sys.argv[1:]])}\n```",
            "",
        ]
    )


def _adapter_description(model: nn.Module, where: str) -> tuple[str, str]:
    """What a PEFT adapter folder holds, and the call that loads it onto its base model with the settings training
    gave the base (a new head's labels)."""
    from acceltrain.hf.adapter_folder import adapter_loading
    from acceltrain.hf.lora import describe

    loader, settings = adapter_loading(model)
    base = model.get_base_model()
    made = (
        f"A LoRA adapter (peft; {describe(model)}) for `{own_class(base).__name__}` (Transformers, "
        f"`{base.config.model_type}`) on the base model `{model.peft_config['default'].base_model_name_or_path}`, "
        "which must be there to load it"
    )

    arguments = "".join(f", {key}={value!r}" for key, value in settings.items())
    return made, (
        f'from peft import {loader}\nmodel = {loader}.from_pretrained("{where}"{arguments})\n'
        f"# or with no arguments (they are in {ADAPTER_SETTINGS_FILE}): from acceltrain import load_model; "
        f'model = load_model("{where}")'
    )


def launch_command() -> list[str]:
    """How this process was started, as a user would type it again: ``python -m package.module``, ``python
    path.py`` or a console script's name (``sys.argv[0]`` is then a full path into the package or the venv)."""
    script = sys.argv[0] if sys.argv and sys.argv[0] else "RECIPE.py"
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and script == getattr(main, "__file__", None):  # python -m
        return ["python", "-m", spec.name.removesuffix(".__main__")]
    if Path(script).parent == Path(sysconfig.get_path("scripts")):  # a console script of this environment
        return [Path(script).name]
    return ["python", script]


def _parameters(model: nn.Module, summary: dict) -> str:
    """The parameter counts of training, as summary.json has them (tied ones once; under ZeRO-3 the full size), and
    the trainable part when it is not all; a merged adapter's folder holds fewer (the adapter's weights merged in)."""
    from acceltrain.hf.lora import parameter_counts

    held = parameter_counts(model)
    trainable, total = summary.get("trainable_parameters", held[0]), summary.get("parameters", held[1])
    counted = f"{total:,} parameters" if trainable == total else f"{trainable:,} trainable of {total:,} parameters"
    return counted if held[1] == total else f"{counted} while training, merged into {held[1]:,}"


def _table(values: dict) -> str:
    if not values:
        return "(none)"
    rows = [f"| {key} | {_cell(value)} |" for key, value in values.items()]
    return "\n".join(["| | |", "| --- | --- |", *rows])


def _cell(value) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value).replace("|", "\\|")


def _weights_step(summary: dict) -> str:
    """Where the weights come from when they are not the last step's (``--load-best-at-end``)."""
    step = summary.get("weights_step")
    if step is None:
        return ""
    return (
        f" Its weights are step {step}'s, the best evaluation (`--load-best-at-end`), of {summary['steps']} steps "
        "trained."
    )
