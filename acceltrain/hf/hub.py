"""Run folders as Hugging Face Hub model repos: what made the model (``config.json``), a model card
(``README.md``), the settings that reproduce it (``train_config.yaml``), one call to load it back
(:func:`load_model`), and the upload behind ``--push-to-hub``.

Loading never runs code named by the folder: ``config.json`` names a builder, looked up in an allow-list
of the builders decorated with :func:`loadable` (the very functions the recipes train with), or is a
Transformers config, loaded by the Auto class of its architecture (:func:`auto_class`) without remote code.
Weights load from safetensors, once the model, built first on the meta device within the memory available,
has exactly the file's tensors. A folder is written only if it will load that way (:func:`check_fits_own_config`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import sys
from collections.abc import Callable
from importlib import import_module
from pathlib import Path

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)

from acceltrain import __version__
from acceltrain.config.options import ConfigError, first_line, parse_json, shorten
from acceltrain.hf.auto_classes import auto_class
from acceltrain.runtime.logs import quiet_model_loading
from acceltrain.runtime.run_folder import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_SETTINGS_FILE,
    ADAPTER_WEIGHTS_FILE,
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    WEIGHTS_FILE,
)

BUILD_ATTRIBUTE = "acceltrain_build"  # set on a built model: {"builder": key, "kwargs": {...}}
_BUILDERS: dict[str, tuple[Callable[..., nn.Module], str]] = {}  # key -> (builder, Hub pipeline tag)
# every module that defines a @loadable builder: load_model imports them, so that the allow-list is complete in any
# process (the packages import their modules lazily: ``import acceltrain.vision`` registers nothing)
LOADABLE_MODULES = ("acceltrain.vision.models",)


def loadable(key: str, pipeline_tag: str) -> Callable:
    """Register a model builder under ``key`` and record, on each model it builds, the key and the
    arguments it was called with: the run folder's ``config.json``, from which :func:`load_model` calls
    the same builder again. Its module belongs in ``LOADABLE_MODULES``."""

    def register(builder: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        signature = inspect.signature(builder)

        @functools.wraps(builder)
        def build(*args, **kwargs) -> nn.Module:
            model = builder(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            setattr(model, BUILD_ATTRIBUTE, {"builder": key, "kwargs": dict(bound.arguments)})
            return model

        _BUILDERS[key] = (build, pipeline_tag)
        return build

    return register


def load_model(name_or_path: str | Path) -> nn.Module:
    """The trained model of a run folder (or of a Hub repo made by ``--push-to-hub``), in eval mode: the
    registered builder that made it with its recorded arguments, then its ``model.safetensors``; a
    Transformers folder through the Auto class of its architecture (``AutoModelForSequenceClassification``,
    ``AutoModelForCausalLM``, ...). Before anything is allocated, the model is built on the meta device, within
    the memory available, and must have exactly the tensors (names and shapes) of ``model.safetensors``: a
    folder that does not make the trained model is one ConfigError. A run's PEFT adapter folder loads onto its base
    model through peft's ``AutoPeftModelFor...`` class, with the labels training gave the base config
    (:func:`acceltrain.hf.adapter_folder.load_adapter`)."""
    folder = _model_folder(str(name_or_path))
    if (folder / ADAPTER_CONFIG_FILE).is_file() and not (folder / CONFIG_FILE).is_file():
        from acceltrain.hf.adapter_folder import load_adapter

        return load_adapter(folder).eval()
    build, load = _model_builders(folder)
    check_matches(_skeleton(build, folder), folder / WEIGHTS_FILE)
    with quiet_model_loading():
        return load().eval()


def model_skeleton(folder: Path) -> nn.Module:
    """The model that ``folder``'s ``config.json`` describes, built on the meta device within the memory available:
    what :func:`load_model` checks the folder's weights against (names and shapes: :func:`weights_mismatch`)."""
    return _skeleton(_model_builders(folder)[0], folder)


def _model_builders(folder: Path) -> tuple[Callable[[], nn.Module], Callable[[], nn.Module]]:
    """(build, load) of the model of ``folder``'s ``config.json``: a Transformers model or an acceltrain builder's."""
    if (folder / ADAPTER_CONFIG_FILE).is_file() and not (folder / CONFIG_FILE).is_file():
        raise ConfigError(
            f"{str(folder)!r} is a PEFT adapter folder ({ADAPTER_CONFIG_FILE}): it has no model of its own "
            "to build; acceltrain.load_model loads it onto its base model"
        )
    config = _read_config(folder)
    if "builder" in config and "model_type" in config:
        raise ConfigError(
            f"{folder / CONFIG_FILE} names both an acceltrain builder ({shorten(config['builder'])}) and a "
            f"Transformers model_type ({shorten(config['model_type'])}): a run writes one or the other"
        )
    return _transformers_model(folder) if "model_type" in config else _acceltrain_model(config, folder)


def _model_folder(name_or_path: str) -> Path:
    """A local folder as it is; a Hub repo name downloaded (its config and weights only)."""
    if Path(name_or_path).expanduser().is_dir():
        return Path(name_or_path).expanduser()
    from huggingface_hub import snapshot_download

    from acceltrain.runtime.network import load_local_or_hub

    files = [
        CONFIG_FILE,
        GENERATION_CONFIG_FILE,
        WEIGHTS_FILE,
        ADAPTER_CONFIG_FILE,
        ADAPTER_WEIGHTS_FILE,
        ADAPTER_SETTINGS_FILE,
    ]
    download = functools.partial(snapshot_download, allow_patterns=files)
    return Path(load_local_or_hub(download, name_or_path, "load_model", "a run folder"))


def _read_config(folder: Path) -> dict:
    try:
        config = parse_json((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"{str(folder)!r} has no readable {CONFIG_FILE} ({first_line(err)}): not a run folder of a finished run"
        ) from None
    if not isinstance(config, dict):
        raise ConfigError(
            f"{folder / CONFIG_FILE} is a JSON {_json_type(config)}, not an object: not a config.json that a run writes"
        )
    return config


def _acceltrain_model(config: dict, folder: Path) -> tuple[Callable[[], nn.Module], Callable[[], nn.Module]]:
    """(build, load): the allow-listed builder that ``config.json`` names, with its recorded arguments; then
    its weights, from model.safetensors."""
    from safetensors.torch import load_model as load_safetensors

    for module in LOADABLE_MODULES:
        import_module(module)
    key, kwargs = config.get("builder"), config.get("kwargs")
    if not isinstance(key, str) or key not in _BUILDERS:
        if "builder" not in config:
            raise ConfigError(
                f"{folder / CONFIG_FILE} names neither an acceltrain builder nor a Transformers model_type: "
                "not a config.json that a run writes"
            )
        raise ConfigError(f"{folder / CONFIG_FILE} names builder {shorten(key)}; known: {', '.join(sorted(_BUILDERS))}")
    if not isinstance(kwargs, dict):
        found = "missing" if kwargs is None else f"a {_json_type(kwargs)}"
        raise ConfigError(
            f"{folder / CONFIG_FILE} 'kwargs' must be a JSON object of the builder's arguments, not {found}"
        )
    build = functools.partial(_BUILDERS[key][0], **kwargs)

    def load() -> nn.Module:
        model = build()
        load_safetensors(model, str(folder / WEIGHTS_FILE))
        return model

    return build, load


def _transformers_model(folder: Path) -> tuple[Callable[[], nn.Module], Callable[[], nn.Module]]:
    """(build, load) of the folder's Transformers model with the class its architecture names, of a model type
    that Transformers itself defines (no remote code); ``load`` reads model.safetensors (and
    generation_config.json) as ``from_pretrained`` does."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except Exception as err:  # noqa: BLE001 - whatever the library makes of a malformed file, the file is at fault
        raise ConfigError(
            f"{folder / CONFIG_FILE} does not build a model: {type(err).__name__}: {first_line(err)}"
        ) from None
    model_class = transformers_class(config, folder)
    return (
        functools.partial(model_class.from_config, config, trust_remote_code=False),
        functools.partial(
            model_class.from_pretrained, folder, config=config, use_safetensors=True, trust_remote_code=False
        ),
    )


def transformers_class(config, folder: Path):
    """The Auto class of ``config``'s architecture, else that architecture's own class in ``transformers``; a
    folder that names neither (a custom architecture) is one line."""
    import transformers

    found = auto_class(config)
    name = found[0] if found else (config.architectures or [None])[0]
    if not isinstance(name, str) or not isinstance(getattr(transformers, name, None), type):
        raise ConfigError(
            f"{folder / CONFIG_FILE} names architectures {shorten(config.architectures)}, which no class of "
            f"transformers {transformers.__version__} builds"
        )
    return getattr(transformers, name)


class _TooLarge(Exception):
    """A model being built grew past the memory available; its argument: the bytes counted so far."""


def _skeleton(build: Callable[[], nn.Module], folder: Path) -> nn.Module:
    """``build()`` on the meta device (no memory, no compute), stopped as soon as its parameters and buffers
    outgrow the memory available: a config.json of absurd sizes is refused in moments, not allocated."""
    import psutil
    from accelerate.utils import convert_bytes

    limit = psutil.virtual_memory().available
    try:
        with torch.device("meta"), _stopped_past(limit):
            return build()
    except _TooLarge as err:
        raise ConfigError(
            f"{folder / CONFIG_FILE} describes a model of more than {convert_bytes(err.args[0])} (parameters and "
            f"buffers) but {convert_bytes(limit)} of memory is available"
        ) from None
    except Exception as err:  # noqa: BLE001 - the arguments come from the file: whatever they break, the file is at fault
        raise ConfigError(
            f"{folder / CONFIG_FILE} does not build a model: {type(err).__name__}: {first_line(err)}"
        ) from None


@contextlib.contextmanager
def _stopped_past(limit: int):
    """Raise _TooLarge from the module that registers a parameter or buffer taking the total past ``limit`` bytes."""
    counted: dict[int, torch.Tensor] = {}  # id -> tensor, kept so that no id is reused for another
    total = 0

    def count(module: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
        nonlocal total
        if tensor is None or id(tensor) in counted:  # a tied weight counts once
            return
        counted[id(tensor)] = tensor
        total += tensor.nbytes
        if total > limit:
            raise _TooLarge(total)

    handles = [register_module_parameter_registration_hook(count), register_module_buffer_registration_hook(count)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def check_matches(skeleton: nn.Module, weights: Path) -> None:
    """The model's tensors are exactly the file's, by name and shape (read from its header): a missing one
    would stay random."""
    problem = weights_mismatch(skeleton, _saved_shapes(weights))
    if problem:
        raise ConfigError(f"{weights} does not match {CONFIG_FILE}: {problem}")


def weights_mismatch(skeleton: nn.Module, saved: dict[str, tuple[int, ...]]) -> str | None:
    """How the tensors ``saved`` (name -> shape) differ from those of ``skeleton`` (built from the config, on the
    meta device), or None when they are the same: missing ones, unexpected ones, ones of another shape."""
    expected = {name: tuple(tensor.shape) for name, tensor in skeleton.state_dict().items()}
    differences = {
        "missing": [repr(name) for name in sorted(expected.keys() - saved.keys())],
        "unexpected": [repr(name) for name in sorted(saved.keys() - expected.keys())],
        "of another shape": [
            f"{name!r} {saved[name]} instead of {expected[name]}"
            for name in sorted(expected.keys() & saved.keys())
            if saved[name] != expected[name]
        ],
    }
    found = [f"{what} {_few(names)}" for what, names in differences.items() if names]
    return "; ".join(found) or None


def _saved_shapes(weights: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(weights), framework="pt") as file:
            return {name: tuple(file.get_slice(name).get_shape()) for name in file.keys()}
    except (OSError, SafetensorError) as err:
        raise ConfigError(
            f"{weights} is not a readable safetensors file ({first_line(err)}): not a run folder of a finished run"
        ) from None


def _few(entries: list[str], shown: int = 3) -> str:
    more = f" and {len(entries) - shown} more" if len(entries) > shown else ""
    return ", ".join(first_line(entry, 120) for entry in entries[:shown]) + more


def _json_type(value) -> str:
    """What a parsed JSON value is, in JSON's words."""
    return {list: "list", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}[
        type(value)
    ]


# --------------------------------------------------------------------------- writing the folder


def write_model_files(model: nn.Module, output_dir: Path) -> str | None:
    """``config.json`` of a model made by a registered builder (a Transformers model's config and a PEFT adapter's
    files are written with its weights: :mod:`acceltrain.train.export`), and beside an adapter the settings its base
    model's config needs; returns the Hub pipeline tag, None for a model that no builder recorded."""
    from acceltrain.hf.adapter_folder import write_adapter_settings
    from acceltrain.hf.lora import is_peft_model

    head = model_head(model)
    if is_peft_model(model):
        write_adapter_settings(model, output_dir)
    if head is not None:
        return head[1]
    build = getattr(model, BUILD_ATTRIBUTE, None)
    if build is None:
        return None
    (output_dir / CONFIG_FILE).write_text(
        json.dumps({**build, "library_name": "acceltrain", "acceltrain_version": __version__}, indent=2) + "\n"
    )
    return _BUILDERS[build["builder"]][1]


def describe_checkpoints(model: nn.Module, checkpoints: Path) -> None:
    """The files that describe the model being trained, written into the run's ``checkpoints/`` folder (by the
    :class:`~acceltrain.hooks.HubReady` hook, at each launch's first save): what ``acceltrain merge`` turns any
    checkpoint into a loadable folder with, also that of a run stopped before its end, whose folder has none of its
    own yet (the run folder gets ``config.json`` with its final weights). A Transformers model's ``config.json`` (its
    class in ``architectures``, as ``save_pretrained`` writes it) and ``generation_config.json``; for a PEFT model its
    base model's, as training set them (a new head's labels), and its ``adapter_config.json``; a registered builder's
    ``config.json``; nothing for a module that no config describes. Each file is replaced whole."""
    import copy
    import tempfile

    from acceltrain.hf.lora import is_peft_model

    base = model.get_base_model() if is_peft_model(model) else model
    with tempfile.TemporaryDirectory(dir=checkpoints) as staging:
        if is_transformers_model(base):
            config = copy.deepcopy(base.config)
            config.architectures = [own_class(base).__name__]
            config.save_pretrained(staging)
            if base.can_generate():
                base.generation_config.save_pretrained(staging)
            if is_peft_model(model):
                model.peft_config["default"].save_pretrained(staging)
        else:
            write_model_files(base, Path(staging))
        for name in os.listdir(staging):
            os.replace(Path(staging) / name, checkpoints / name)


def model_head(model: nn.Module) -> tuple[str, str] | None:
    """(Auto class, pipeline tag) of a Transformers model, or of a PEFT adapter's base model, by its class: the
    class ``save_pretrained`` records in ``config.architectures``. None for any other module, and for an
    architecture no Auto class knows (the card then names the class itself)."""
    from acceltrain.hf.lora import is_peft_model

    base = model.get_base_model() if is_peft_model(model) else model
    return auto_class(base.config, architecture=own_class(base).__name__) if is_transformers_model(base) else None


def own_class(model: nn.Module) -> type:
    """The model's class as its library defines it: FSDP2 gives each module it shards a class of its own, a
    subclass named after it (``FSDPGPT2LMHeadModel``)."""
    return next(cls for cls in type(model).__mro__ if not cls.__module__.startswith("torch.distributed"))


def is_transformers_model(model: nn.Module) -> bool:
    """A Transformers ``PreTrainedModel`` (which ``save_pretrained`` writes), not any module with a ``config``: a
    wrapper around one has other weight names than its config's model."""
    transformers = sys.modules.get("transformers")  # a model of that kind has imported it
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def check_fits_own_config(model: nn.Module, shapes: dict[str, tuple[int, ...]] | None = None) -> None:
    """A Transformers model whose weights (``shapes``: name -> shape; default: the model's own) would not load
    into the model its own config builds is one ConfigError: ``from_pretrained`` would leave the missing ones
    random with a warning only (a module replaced after loading, a wrapper inside it)."""
    import copy

    if shapes is None:  # the parameters themselves: under DeepSpeed ZeRO-3 a partitioned one knows its full shape
        shapes = {
            name: tuple(getattr(tensor, "ds_shape", tensor.shape))
            for name, tensor in model.state_dict(keep_vars=True).items()
        }
    with torch.device("meta"):
        skeleton = own_class(model)._from_config(copy.deepcopy(model.config))
    problem = weights_mismatch(skeleton, shapes)
    if problem:
        raise ConfigError(
            f"the {own_class(model).__name__}'s weights would not load into the model its own {CONFIG_FILE} builds, so "
            f"from_pretrained would leave them random: {problem}; keep its modules as its config builds them"
        )
