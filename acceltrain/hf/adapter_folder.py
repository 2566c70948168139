"""A LoRA run's adapter folder (peft's ``adapter_config.json`` and ``adapter_model.safetensors``) beside what
training changed in its base model's config (``adapter_base_settings.json``: a new head's labels), so that it loads
with no argument: written at the end of a run, read by :func:`acceltrain.load_model`."""

from __future__ import annotations

from acceltrain.config.options import ConfigError, first_line
from acceltrain.hf.lora import PEFT_TASKS, peft_task
from acceltrain.runtime.logs import log_on_main_process
from acceltrain.runtime.run_folder import ADAPTER_SETTINGS_FILE


def adapter_loading(model) -> tuple[str, dict]:
    """(the peft class that loads this adapter, the base config's settings that training changed, such as the
    labels of a new classification head: what ``from_pretrained`` must be given to rebuild the same model)."""
    from transformers import AutoConfig

    base = model.get_base_model()
    adapter = model.peft_config["default"]
    trained = base.config.to_dict()
    original = AutoConfig.from_pretrained(adapter.base_model_name_or_path).to_dict()
    bookkeeping = {
        "architectures",
        "_name_or_path",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "_attn_implementation_autoset",
    }
    changed = {key: value for key, value in trained.items() if key not in bookkeeping and original.get(key) != value}
    return peft_task(base)[1], _int_ids(changed)


def _int_ids(settings: dict) -> dict:
    """JSON keeps a config's class ids as strings; ``from_pretrained`` wants them back as ints."""
    if "id2label" in settings:
        settings = {**settings, "id2label": {int(key): value for key, value in settings["id2label"].items()}}
    return settings


def _settings_from_report(folder) -> dict:
    """A classifier adapter folder without adapter_base_settings.json (written before that file existed, or a copy
    that lost it) would load onto its base config's LABEL_0, LABEL_1, ...: its classes are those its
    classification_report.json records, in class order; one line when it has none."""
    from acceltrain.config.options import parse_json, read_small_file
    from acceltrain.runtime.run_folder import REPORT_FILE

    try:
        classes = parse_json(read_small_file(str(folder / REPORT_FILE), "the run's")).get("labels")
    except (ValueError, AttributeError):  # ConfigError included: no such file
        classes = None
    if not (isinstance(classes, list) and len(classes) >= 2 and all(isinstance(name, str) for name in classes)):
        raise ConfigError(
            f"{str(folder)!r} is a LoRA classifier folder that has no {ADAPTER_SETTINGS_FILE} and no readable "
            f"{REPORT_FILE} to name its classes (its base config would call them LABEL_0, LABEL_1, ...): write its "
            f"{ADAPTER_SETTINGS_FILE} with the id2label and label2id of its README.md's load line"
        )
    log_on_main_process(
        __name__,
        f"{str(folder)!r} has no {ADAPTER_SETTINGS_FILE}: its classes are those of its {REPORT_FILE}: {classes}",
    )
    return {
        "num_labels": len(classes),
        "id2label": dict(enumerate(classes)),
        "label2id": {name: index for index, name in enumerate(classes)},
    }


def write_adapter_settings(model, folder) -> None:
    """The settings training gave the base model's config (a new head's labels), beside the adapter: peft rebuilds
    the base from its own folder's config, so they must be given to ``from_pretrained``; :func:`load_adapter` reads
    them."""
    import json

    (folder / ADAPTER_SETTINGS_FILE).write_text(json.dumps(adapter_loading(model)[1], indent=2) + "\n")


def load_adapter(folder):
    """A run's adapter folder as a peft model on its base model, with the settings of its
    ``adapter_base_settings.json`` (a new head's labels): no argument to add. The base model must be where
    ``adapter_config.json`` says."""
    import peft

    from acceltrain.config.options import parse_json
    from acceltrain.runtime.logs import quiet_model_loading
    from acceltrain.runtime.network import load_local_or_hub

    settings_file = folder / ADAPTER_SETTINGS_FILE
    try:
        task = parse_json((folder / "adapter_config.json").read_text()).get("task_type")
        settings = parse_json(settings_file.read_text()) if settings_file.is_file() else None
    except (OSError, ValueError, AttributeError) as err:
        raise ConfigError(
            f"{str(folder)!r}: its adapter_config.json or {ADAPTER_SETTINGS_FILE} is unreadable ({first_line(err)})"
        ) from None
    if settings is None:
        settings = _settings_from_report(folder) if task == "SEQ_CLS" else {}
    loaders = {peft_task: loader for peft_task, loader in PEFT_TASKS.values()}
    if task not in loaders or not isinstance(settings, dict):
        raise ConfigError(
            f"{str(folder)!r}: an adapter of task type {task!r}, which loads with none of peft's "
            f"{', '.join(loaders.values())}"
        )
    loader = getattr(peft, loaders[task])

    def load(source: str):
        try:
            return loader.from_pretrained(source, **_int_ids(settings))
        except RuntimeError as err:  # a head of other labels than the base config's, in a folder without the settings
            found = next((line.strip() for line in str(err).splitlines() if "size mismatch" in line), first_line(err))
            raise ValueError(
                f"{found[:110]} (without {ADAPTER_SETTINGS_FILE}, give the settings its README.md shows to "
                "peft's from_pretrained)"
            ) from None

    with quiet_model_loading():
        return load_local_or_hub(load, str(folder), "the adapter folder", "the adapter onto its base model")
