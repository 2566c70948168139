"""LoRA fine-tuning through peft: the option group (``--lora-r`` ...), :func:`apply_lora` for any pretrained
Transformers model handed to ``fit()``, and what the run folder needs to know of an adapter
(:mod:`acceltrain.train.export` writes it, :mod:`acceltrain.hf.hub` describes it).

One thing peft leaves to its user: weights the base checkpoint does not hold (a classification head, or the
pooler of a BERT saved without one) are random when the model is loaded, and an adapter that does not carry
them reloads onto other random values. peft saves the usual head names (``classifier``, ``score``) with the
adapter; :func:`apply_lora` trains and saves every such module in full (peft's ``modules_to_save``).

The option group holds no torch, so a recipe's ``--help`` answers at once; peft is imported when used
(``pip install 'acceltrain[peft]'``).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
from collections.abc import Iterable

from acceltrain.config.options import ConfigError, Options, first_line, flag_name, option, require
from acceltrain.runtime.logs import log_on_main_process

__all__ = [
    "LoraOptions",
    "apply_lora",
    "check_backend",
    "is_peft_model",
    "merge_requested",
    "parameter_counts",
]

MERGE_ATTRIBUTE = (
    "acceltrain_merge_lora"  # set on the peft model: the run folder gets it merged (acceltrain.train.export)
)
ALL_LINEAR = "all-linear"  # peft's own name for every linear layer but the output head
# the Auto class of the base model's head -> (peft task type, the AutoPeftModel class that loads its adapter)
PEFT_TASKS = {
    "AutoModelForCausalLM": ("CAUSAL_LM", "AutoPeftModelForCausalLM"),
    "AutoModelForSequenceClassification": ("SEQ_CLS", "AutoPeftModelForSequenceClassification"),
    "AutoModelForTokenClassification": ("TOKEN_CLS", "AutoPeftModelForTokenClassification"),
    "AutoModelForQuestionAnswering": ("QUESTION_ANS", "AutoPeftModelForQuestionAnswering"),
    "AutoModelForSeq2SeqLM": ("SEQ_2_SEQ_LM", "AutoPeftModelForSeq2SeqLM"),
    "AutoModel": ("FEATURE_EXTRACTION", "AutoPeftModelForFeatureExtraction"),
}


@dataclasses.dataclass
class LoraOptions(Options):
    """A LoRA adapter instead of full fine-tuning (peft): its rank, scale, dropout and target modules, and
    whether the run folder holds the adapter or the base weights with it merged in."""

    lora_r: int | None = option(
        None,
        "train a LoRA adapter of this rank (peft) instead of every weight; the run folder is then a PEFT adapter "
        "folder",
    )
    lora_alpha: float | None = option(
        None, "LoRA scale numerator: the adapter's update is scaled by alpha / r (default: 2 x --lora-r)"
    )
    lora_dropout: float = option(0.0, "dropout on the input of the LoRA branches")
    lora_target_modules: str | None = option(
        None,
        "modules that get an adapter: comma-separated names or name suffixes (q_proj,v_proj), or all-linear; "
        "default: peft's choice for the architecture",
        list_like=True,
    )
    merge_lora: bool = option(
        False, "write the adapter merged into the base weights (merge_and_unload): a plain Transformers folder"
    )

    def resolved(self) -> dict:
        alpha = {"lora_alpha": self.lora_alpha or 2 * self.lora_r} if self.lora_r is not None else {}
        return {**super().resolved(), **alpha}

    def validate(self) -> None:
        super().validate()
        if self.lora_r is None:
            for name, default in (
                ("lora_alpha", None),
                ("lora_dropout", 0.0),
                ("lora_target_modules", None),
                ("merge_lora", False),
            ):
                if getattr(self, name) != default:
                    raise ConfigError(f"--{flag_name(name)} needs --lora-r (the rank of the LoRA adapter to train)")
            return
        require(self.lora_r >= 1, "lora_r", self.lora_r, "an integer >= 1")
        if importlib.util.find_spec("peft") is None:  # said before any work, not at the adapter
            raise ConfigError(
                "--lora-r trains the adapter with peft, which is not installed: pip install 'acceltrain[peft]'"
            )
        if self.lora_alpha is not None:
            require(self.lora_alpha > 0, "lora_alpha", self.lora_alpha, "a number > 0")
        require(0 <= self.lora_dropout < 1, "lora_dropout", self.lora_dropout, "a number in [0, 1)")
        if self.lora_target_modules is not None:
            require(
                bool(_target_names(self.lora_target_modules)),
                "lora_target_modules",
                self.lora_target_modules,
                f"module names, or {ALL_LINEAR}",
            )


def apply_lora(model, options: LoraOptions, *, missing_keys: Iterable[str] | None = None):
    """``model``, a pretrained Transformers model, wrapped by peft with a LoRA adapter as ``options`` say: every
    base weight frozen but those its checkpoint did not hold, which are trained in full and saved with the
    adapter. Returns the peft model: hand it to ``build_optimizer`` and ``fit()`` as it is; the run folder is
    then a PEFT adapter folder (or, with ``merge_lora``, the merged model). Logs the trainable and total
    parameter counts.

    ``missing_keys``: the weights ``from_pretrained`` initialised rather than loaded, from
    ``from_pretrained(..., output_loading_info=True)``; without it the base model is loaded a second time to
    find them (the weights whose values a new load does not reproduce)."""
    from peft import LoraConfig, get_peft_model

    from acceltrain.runtime.logs import quiet_model_loading

    if options.lora_r is None:
        raise ConfigError("apply_lora needs options with lora_r set (--lora-r): the rank of the adapter")
    if is_peft_model(model):
        raise ConfigError(
            "--lora-r adds a LoRA adapter to a model that has one (--model-name-or-path a PEFT adapter "
            "folder: its adapter trains on, with its own settings): drop --lora-r"
        )
    task_type = peft_task(model)[0]
    fresh = _fresh_modules(model, _fresh_parameters(model, missing_keys))
    inside_fresh = sorted(name for name, _ in model.named_modules() if any(_within(name, top) for top in fresh))
    config = LoraConfig(
        r=options.lora_r,
        lora_alpha=options.resolved()["lora_alpha"],
        lora_dropout=options.lora_dropout,
        target_modules=_targets(model, options.lora_target_modules, inside_fresh),
        task_type=task_type,
        modules_to_save=fresh or None,
        exclude_modules=inside_fresh or None,
    )
    try:
        with quiet_model_loading():  # peft reads transformers' deprecated is_gradient_checkpointing
            peft_model = get_peft_model(model, config)
    except ValueError as err:  # no default target modules for this architecture, a module peft cannot adapt
        raise ConfigError(
            f"LoRA cannot adapt this {type(model).__name__}: {first_line(err)} (--lora-target-modules names the "
            "modules)"
        ) from None
    adapter_config = peft_model.peft_config["default"]
    adapter_config.base_model_name_or_path = _portable_base(adapter_config.base_model_name_or_path)
    setattr(peft_model, MERGE_ATTRIBUTE, options.merge_lora)
    trainable, total = parameter_counts(peft_model)
    log_on_main_process(
        __name__,
        f"LoRA {describe(peft_model)}: {trainable:,} trainable of {total:,} parameters "
        f"({100 * trainable / total:.2f}%)",
    )
    return peft_model


def is_peft_model(model) -> bool:
    """Whether ``model`` (unwrapped) is a peft model. peft is only imported where it is already in use."""
    import sys

    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def merge_requested(model) -> bool:
    return bool(getattr(model, MERGE_ATTRIBUTE, False))


def check_backend(engine=None, *, merge: bool) -> None:
    """Refuse, in one line, an engine that cannot train or write an adapter: ``engine`` (a class or a run's), by
    default the one the launch asks for (before the process group: DeepSpeed's start-up takes minutes on a CPU)."""
    from acceltrain.engines import launch_engine

    engine = engine or launch_engine()
    engine.refuse_setting("lora")
    if merge:
        engine.refuse_setting("merge_lora")


def parameter_counts(model) -> tuple[int, int]:
    """(trainable, total) parameters, tied ones once; under DeepSpeed ZeRO-3 the full size of partitioned ones."""
    params = list(model.parameters())
    size = lambda param: getattr(param, "ds_numel", param.numel())  # noqa: E731
    return sum(size(p) for p in params if p.requires_grad), sum(size(p) for p in params)


def describe(model) -> str:
    """The adapter of a peft model in one line: rank, scale, the modules adapted (by their own names) and those
    trained in full."""
    adapter = model.peft_config["default"]
    targets = model.base_model.targeted_module_names
    prefix = "base_model.model."
    in_full = [
        name.removeprefix(prefix)
        for name, module in model.named_modules()
        if type(module).__name__ == "ModulesToSaveWrapper"
    ]
    shown = ", ".join(sorted({name.rpartition(".")[2] for name in targets}))
    full = f"; trained in full: {', '.join(in_full)}" if in_full else ""
    return f"r={adapter.r}, alpha={adapter.lora_alpha:g}, on {len(targets)} modules ({shown}){full}"


def merged(model, weights: dict | None):
    """The plain Transformers model with the adapter merged into its weights (``weights``: the peft model's
    state to merge, when a hook asked to export other weights than the model's own)."""
    if weights is not None:
        model.load_state_dict(weights)
    return model.merge_and_unload()


# --------------------------------------------------------------------------- what apply_lora works out


def peft_task(model) -> tuple[str | None, str]:
    """(peft task type, AutoPeftModel class) of a Transformers model's head; (None, "PeftModel") for a head peft
    has no task for."""
    from acceltrain.hf.auto_classes import auto_class

    found = auto_class(model.config, architecture=type(model).__name__)
    return PEFT_TASKS.get(found[0] if found else None, (None, "PeftModel"))


def _fresh_parameters(model, missing_keys: Iterable[str] | None) -> set[str]:
    """The parameters (every name of a tied one) that loading the base model initialised instead of reading."""
    names_of: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), set()).add(name)
    if missing_keys is None:
        missing_keys = _not_reproduced(model)
    missing = set(missing_keys)
    return {name for names in names_of.values() if names & missing for name in names}


def _not_reproduced(model) -> set[str]:
    """The parameters whose values a second load of the base checkpoint does not give back: initialised, not read."""
    import torch

    if not model.name_or_path:
        raise ConfigError(
            f"apply_lora: this {type(model).__name__} was not loaded with from_pretrained, so no checkpoint holds its "
            "base weights: LoRA adapts a pretrained model (load it with from_pretrained)"
        )
    log_on_main_process(
        __name__,
        f"LoRA: loading {model.name_or_path} again to find the weights its checkpoint does not hold (pass "
        "missing_keys= from from_pretrained(..., output_loading_info=True) to skip this)",
    )
    again = dict(
        type(model).from_pretrained(model.name_or_path, config=model.config).named_parameters(remove_duplicate=False)
    )
    return {
        name
        for name, param in model.named_parameters(remove_duplicate=False)
        if name not in again or not torch.equal(param.detach().cpu(), again[name].detach())
    }


def _fresh_modules(model, fresh_parameters: set[str]) -> list[str]:
    """The modules that own a fresh parameter, each replaced by its parent while that parent holds nothing else
    (no parameter of its own, every child with parameters selected): what is trained and saved in full."""
    modules = dict(model.named_modules())
    selected = {name.rpartition(".")[0] for name in fresh_parameters}
    grown = True
    while grown:
        grown = False
        for name in sorted(selected, key=len, reverse=True):
            parent = name.rpartition(".")[0] if "." in name else None
            if not parent or parent in selected or name not in selected:
                continue
            children = {
                f"{parent}.{child}"
                for child, module in modules[parent].named_children()
                if next(module.parameters(), None) is not None
            }
            if next(modules[parent].parameters(recurse=False), None) is None and children <= selected:
                selected = (selected - children) | {parent}
                grown = True
    return sorted(name for name in selected if not any(other != name and _within(name, other) for other in selected))


def _within(name: str, module: str) -> bool:
    return name == module or name.startswith(f"{module}.")


def _target_names(spec: str) -> list[str]:
    return [part.strip() for part in spec.split(",") if part.strip()]


def _targets(model, spec: str | None, excluded: list[str]):
    """``--lora-target-modules`` as peft takes it, each name checked against the model: one line naming the close
    names (and the linear layers an adapter may go on) when a name matches no module, or only modules ``excluded``
    (those trained in full)."""
    if spec is None:
        return None  # peft's default for the architecture (peft names it when it has none)
    names = _target_names(spec)
    if names == [ALL_LINEAR]:
        return ALL_LINEAR
    every = [(name, module) for name, module in model.named_modules() if name]
    adaptable = [(name, module) for name, module in every if not any(_within(name, fresh) for fresh in excluded)]
    linear = sorted({name.rpartition(".")[2] for name, module in adaptable if _is_linear(module)})
    shown_linear = f"its linear layers to adapt: {', '.join(linear) or 'none'} (or {ALL_LINEAR})"
    for target in names:
        if _matches(target, adaptable):
            continue
        flag = f"--lora-target-modules {target!r}"
        if _matches(target, every):  # inside a new module (a head the checkpoint lacks), which apply_lora excludes
            raise ConfigError(
                f"{flag} is trained in full, not adapted: the checkpoint of this {type(model).__name__} "
                "does not hold it, so it is trained and saved whole with the adapter (peft's "
                f"modules_to_save); {shown_linear}"
            )
        leaves = sorted({name.rpartition(".")[2] for name, _ in adaptable})
        close = difflib.get_close_matches(target, leaves, n=4, cutoff=0.5)
        shown_close = f": close names: {', '.join(close)}" if close else ""
        raise ConfigError(f"{flag} is not a module of {type(model).__name__}{shown_close}; {shown_linear}")
    return names


def _matches(target: str, modules: list) -> bool:
    """Whether a ``(name, module)`` of ``modules`` is ``target`` or ends with it, as peft matches a target name."""
    return any(name == target or name.endswith(f".{target}") for name, _ in modules)


def _is_linear(module) -> bool:
    from torch import nn

    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"  # GPT-2's linear layers


def _portable_base(base: str | None) -> str | None:
    """A local base folder as an absolute path in adapter_config.json: the adapter then loads from any folder."""
    from pathlib import Path

    path = Path(base).expanduser() if base else None
    return str(path.resolve()) if path is not None and path.is_dir() else base
