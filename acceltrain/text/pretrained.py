"""A pretrained Transformers folder (or, online, a Hub model) to fine-tune: the model with the head a recipe
needs, and its tokenizer, each checked before any training. ``from_pretrained`` is lenient where a run must
not be: a folder whose weights do not fit its config loads as a random model with a warning, and a folder
without tokenizer files loads as an empty tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

from accelerate.logging import get_logger

from ..distributed import on_main_process_first
from ..hub import _few
from ..logs import quiet_model_loading
from ..options import ConfigError
from .corpus import load_local_or_hub, load_tokenizer

logger = get_logger(__name__)

FLAG = "--model-name-or-path"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # a saved tokenizer has one of them


def load_pretrained(auto_class: str, name_or_path: str, **settings):
    """(model, missing keys): ``<auto_class>.from_pretrained(name_or_path, **settings)`` (``settings``: config
    values such as ``num_labels``), and the weights it initialised instead of reading (a new head: what
    :func:`acceltrain.apply_lora` trains in full). A checkpoint that does not even hold the model's embeddings
    (a PEFT adapter's weights, another model's) is refused in one line."""
    import transformers

    model_class = getattr(transformers, auto_class)

    def load():
        with quiet_model_loading():  # its LOAD REPORT table: the lines below say what it means
            return load_local_or_hub(
                lambda source: model_class.from_pretrained(source, output_loading_info=True, **settings),
                name_or_path, FLAG, "a model")

    model, info = on_main_process_first(load)
    reshaped = sorted(key for key, *_ in info.get("mismatched_keys", ()))
    if reshaped:
        logger.info(f"{FLAG} {name_or_path!r}: {len(reshaped)} tensors of another shape ({_few(reshaped)}) start "
                    "afresh: a head for other labels")
    new = sorted(set(info["missing_keys"]) - set(reshaped))
    if new:
        logger.info(f"{FLAG} {name_or_path!r}: {len(new)} tensors the checkpoint lacks ({_few(new)}) start from random "
                    "values (a new head)")
    missing = set(info["missing_keys"]) | set(reshaped)
    embeddings = next(f"{name}.weight" for name, module in model.named_modules() if module is model.get_input_embeddings())
    if embeddings in missing:
        unexpected = sorted(info["unexpected_keys"])
        found = f"; it holds {', '.join(repr(key) for key in unexpected[:2])}{' ...' if len(unexpected) > 2 else ''}" if unexpected else ""
        raise ConfigError(f"{FLAG} {name_or_path!r}: its weights do not fit its config.json ({len(missing)} of the model's tensors "
                          f"missing, {embeddings!r} among them{found}): a PEFT model's weights saved as a model's? Give the base "
                          "model's folder here (an adapter loads onto it with peft)")
    return model, sorted(missing)


def pretrained_tokenizer(tokenizer: str | None, model_name_or_path: str, *, flag: str = FLAG):
    """``--tokenizer``, else the model folder's own, with a pad token for batches padded per batch: its own, or
    its end-of-text token (logged); neither is one line. ``flag`` names the model folder in messages."""
    if tokenizer is not None:
        source, flag = tokenizer, "--tokenizer"
    else:
        source = model_name_or_path
        folder = Path(source).expanduser()
        if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
            raise ConfigError(f"{flag} {source!r} has no tokenizer (no {' or '.join(TOKENIZER_FILES)}): save the "
                              "model's tokenizer there, or give one with --tokenizer")
    loaded = on_main_process_first(lambda: load_tokenizer(source, flag))
    if loaded.pad_token is None:
        if loaded.eos_token is None:
            raise ConfigError(f"{flag} {source!r}: the tokenizer has neither a pad token nor an end-of-text token to pad batches "
                              "with: add a pad token (tokenizer.add_special_tokens) and save it")
        loaded.pad_token = loaded.eos_token
        logger.info(f"tokenizer: no pad token; batches are padded with the end-of-text token {loaded.eos_token!r} (masked out)")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # map and loader workers fork after the tokenizer ran
    return loaded


def check_vocabulary(model, tokenizer, name_or_path: str) -> None:
    """A tokenizer with more tokens than the model embeds would index past its embedding table."""
    embedded = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > embedded:
        raise ConfigError(f"{FLAG} {name_or_path!r} embeds {embedded} tokens but the tokenizer has {len(tokenizer)}: use the "
                          "model's own tokenizer (--tokenizer)")
