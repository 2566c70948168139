"""A pretrained Transformers folder (or, online, a Hub model) to fine-tune: the model with the head a recipe
needs, and its tokenizer, each checked before any training. ``from_pretrained`` is lenient where a run must
not be: a folder whose weights do not fit its config loads as a random model with a warning, and a folder
without tokenizer files loads as an empty tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

from accelerate.logging import get_logger

from acceltrain.config.options import ConfigError
from acceltrain.hf.hub import _few
from acceltrain.runtime.distributed import on_main_process_first
from acceltrain.runtime.logs import quiet_model_loading
from acceltrain.runtime.network import load_local_or_hub, one_line
from acceltrain.text.corpus import load_tokenizer

logger = get_logger(__name__)

FLAG = "--model-name-or-path"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # a saved tokenizer has one of them


def load_pretrained(auto_class: str, name_or_path: str, **settings):
    """(model, missing keys): ``<auto_class>.from_pretrained(name_or_path, **settings)`` (``settings``: config
    values such as ``num_labels``), and the weights it initialised instead of reading (a new head: what
    :func:`acceltrain.apply_lora` trains in full). A checkpoint that does not even hold the model's embeddings
    (a PEFT adapter's weights, another model's) is refused in one line. A PEFT adapter folder is its base model
    with the adapter on it, trainable (:func:`continue_adapter`; Transformers would load it frozen)."""
    import transformers

    model_class = getattr(transformers, auto_class)
    base = adapter_base(name_or_path)
    source, flag = name_or_path, FLAG
    if base:
        source, flag = base, f"the base model of {FLAG} {name_or_path!r} (its adapter_config.json)"

    def load():
        with quiet_model_loading():  # its LOAD REPORT table: the lines below say what it means
            return load_local_or_hub(
                lambda path: model_class.from_pretrained(path, output_loading_info=True, **settings),
                source,
                flag,
                "a model",
            )

    model, info = on_main_process_first(load)
    reshaped = sorted(key for key, *_ in info.get("mismatched_keys", ()))
    if reshaped:
        logger.info(
            f"{FLAG} {name_or_path!r}: {len(reshaped)} tensors of another shape ({_few(reshaped)}) start "
            "afresh: a head for other labels"
        )
    new = sorted(set(info["missing_keys"]) - set(reshaped))
    if new:
        logger.info(
            f"{FLAG} {name_or_path!r}: {len(new)} tensors the checkpoint lacks ({_few(new)}) start from random "
            "values (a new head)"
        )
    missing = set(info["missing_keys"]) | set(reshaped)
    embeddings = next(
        f"{name}.weight" for name, module in model.named_modules() if module is model.get_input_embeddings()
    )
    if embeddings in missing:
        unexpected = sorted(info["unexpected_keys"])
        found = (
            f"; it holds {', '.join(repr(key) for key in unexpected[:2])}{' ...' if len(unexpected) > 2 else ''}"
            if unexpected
            else ""
        )
        raise ConfigError(
            f"{FLAG} {name_or_path!r}: its weights do not fit its config.json ({len(missing)} of the model's tensors "
            f"missing, {embeddings!r} among them{found}): a PEFT model's weights saved as a model's? Give the base "
            "model's folder here (an adapter loads onto it with peft)"
        )
    if base:
        model = continue_adapter(model, name_or_path, missing)
    return model, sorted(missing)


def adapter_base(name_or_path: str) -> str | None:
    """The base model of a PEFT adapter folder (or Hub repo: ``adapter_config.json``, as Transformers finds it), else
    None."""
    from transformers.utils import find_adapter_config_file

    try:
        if find_adapter_config_file(name_or_path) is None:
            return None
    except OSError:  # neither a folder nor a repo name: loading it says so
        return None
    from peft import PeftConfig

    adapter = load_local_or_hub(PeftConfig.from_pretrained, name_or_path, FLAG, "a PEFT adapter's config")
    if not adapter.base_model_name_or_path:
        raise ConfigError(
            f"{FLAG} {name_or_path!r} is a PEFT adapter folder whose adapter_config.json names no base "
            "model (base_model_name_or_path)"
        )
    return adapter.base_model_name_or_path


def continue_adapter(base, name_or_path: str, missing: set[str]):
    """The LoRA adapter of ``name_or_path`` on ``base`` (its base model, loaded as the recipe loads one), trainable: an
    adapter folder given as the model to fine-tune trains on, from its weights, with its own settings. A weight the
    base checkpoint lacks (``missing``) that the adapter does not carry either would train frozen at random values:
    one line, as is an adapter that does not fit (a head for another number of labels)."""
    from peft import PeftModel

    from acceltrain.hf.lora import describe, parameter_counts

    try:
        model = PeftModel.from_pretrained(base, name_or_path, is_trainable=True)
    except (RuntimeError, ValueError, KeyError) as err:
        raise ConfigError(
            f"{FLAG} {name_or_path!r}: its LoRA adapter does not load onto its base model ({one_line(err, 400)})"
        ) from None
    trained = {
        name.removeprefix("base_model.model.").replace(".base_layer.", "."): param.requires_grad
        for name, param in model.named_parameters()
    }
    random = sorted(name for name in missing if trained.get(name) is False)
    if random:
        more = " ..." if len(random) > 3 else ""
        raise ConfigError(
            f"{FLAG} {name_or_path!r}: its LoRA adapter does not carry {', '.join(random[:3])}{more}, "
            "which its base model lacks too: they would train frozen at random values (an adapter saved "
            "without its new head?)"
        )
    trainable, total = parameter_counts(model)
    logger.info(
        f"continues training the LoRA adapter of {FLAG} {name_or_path!r} ({describe(model)}): "
        f"{trainable:,} trainable of {total:,} parameters"
    )
    return model


def pretrained_tokenizer(tokenizer: str | None, model_name_or_path: str, *, flag: str = FLAG):
    """``--tokenizer``, else the model folder's own, with a pad token for batches padded per batch: its own, or
    its end-of-text token (logged); neither is one line. ``flag`` names the model folder in messages."""
    if tokenizer is not None:
        source, flag = tokenizer, "--tokenizer"
    else:
        source = model_name_or_path
        folder = Path(source).expanduser()
        if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
            raise ConfigError(
                f"{flag} {source!r} has no tokenizer (no {' or '.join(TOKENIZER_FILES)}): save the "
                "model's tokenizer there, or give one with --tokenizer"
            )
    loaded = on_main_process_first(lambda: load_tokenizer(source, flag))
    if loaded.pad_token is None:
        if loaded.eos_token is None:
            raise ConfigError(
                f"{flag} {source!r}: the tokenizer has neither a pad token nor an end-of-text token to pad batches "
                "with: add a pad token (tokenizer.add_special_tokens) and save it"
            )
        loaded.pad_token = loaded.eos_token
        logger.info(
            f"tokenizer: no pad token; batches are padded with the end-of-text token {loaded.eos_token!r} (masked out)"
        )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # map and loader workers fork after the tokenizer ran
    return loaded


def model_positions(model) -> int | None:
    """The positions a Transformers model embeds (GPT-2's ``n_positions``, else ``max_position_embeddings``), if its
    config says."""
    config = model.config
    return getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)


def check_length(length: int, flag: str, model, name_or_path: str) -> None:
    """A sequence length ``flag`` asks for that is longer than the model's positions: one line now, not an index
    error inside the model at the first long batch."""
    positions = model_positions(model)
    if positions is not None and length > positions:
        raise ConfigError(f"{flag} {length} is longer than {FLAG} {name_or_path!r} supports ({positions} positions)")


def fitting_length(length: int | None, default: int, flag: str, model, name_or_path: str) -> int:
    """``length`` as given, checked (:func:`check_length`); unset (None): ``default``, cut to the model's positions
    when they are fewer, logged (Transformers' ``run_clm.py``: ``min(default, the model's limit)``)."""
    if length is not None:
        check_length(length, flag, model, name_or_path)
        return length
    positions = model_positions(model)
    if positions is None or positions >= default:
        return default
    logger.info(f"{flag} {positions}: the positions of {FLAG} {name_or_path!r} (the default, {default}, is longer)")
    return positions


def embedded_tokens(model) -> int:
    """The rows of the model's input embedding table (beneath a LoRA adapter on it)."""
    embeddings = model.get_input_embeddings()
    return getattr(embeddings, "get_base_layer", lambda: embeddings)().num_embeddings


def check_vocabulary(model, tokenizer, name_or_path: str) -> None:
    """A tokenizer with more tokens than the model embeds would index past its embedding table."""
    embedded = embedded_tokens(model)
    if len(tokenizer) > embedded:
        raise ConfigError(
            f"{FLAG} {name_or_path!r} embeds {embedded} tokens but the tokenizer has {len(tokenizer)}: use the "
            "model's own tokenizer (--tokenizer)"
        )
