"""``acceltrain merge CHECKPOINT OUT``: a checkpoint's model as a folder that loads by itself, ``model.safetensors``
with its ``config.json`` and generation config, and the run folder's tokenizer files (``from_pretrained(OUT)`` for a
Transformers model, :func:`acceltrain.load_model` for one of the toolkit's). The config is the one the run writes
beside its checkpoints at its first save (a stopped run's folder has none of its own), else the run folder's; the
weights must be exactly those of the model it builds (a checkpoint of another model is refused, tied weights are
written under each name, as the run folder holds them). A LoRA run's checkpoint (its adapter's weights, peft-named)
is merged into its base model, which must be there (``merge_and_unload``): a plain Transformers folder. FSDP's DCP
shards are merged on one process, with no process group (Accelerate's ``merge_fsdp_weights``); a DDP or one-process
checkpoint's weights are taken as they are, without DDP's ``module.`` prefix. The checkpoint is verified first
(manifest, and no file that would run code); ``OUT`` must be new or empty, and a refusal leaves it as it was. A
module that no config describes (a recipe's own) gets its weights alone, as its run folder does. It runs on one
process: under a launcher it refuses before anything is read or written."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from acceltrain.config.options import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
PEFT_PREFIX = "base_model.model."  # a peft model's own names: a LoRA run's checkpoint


def merge(checkpoint: Path, out: Path) -> Path:
    """Write ``out/model.safetensors`` and the files that describe it from ``checkpoint``; returns the weights' path."""
    from acceltrain.checkpoint.files import checkpoint_engine, verify_checkpoint
    from acceltrain.checkpoint.safe_load import check_loadable_without_code
    from acceltrain.engines import writer_of
    from acceltrain.runtime.run_folder import CONFIG_FILE, WEIGHTS_FILE
    from acceltrain.train.export import save_tensors

    _check_is_checkpoint(checkpoint)
    verify_checkpoint(checkpoint)
    check_loadable_without_code(checkpoint, digests_required=True)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"OUT {str(out)!r} exists and is not an empty folder: choose a new one")
    engine = writer_of(checkpoint_engine(checkpoint))
    with _left_as_found(out):
        tensors = engine.merged_weights(checkpoint, out)  # each engine's checkpoints merge its own way
        if any(name.startswith(PEFT_PREFIX) for name in tensors):
            _merge_adapter(tensors, checkpoint, out)
        elif _described(checkpoint, CONFIG_FILE) is not None:
            _write_described(tensors, checkpoint, out)
        else:
            save_tensors(tensors, out)
        run_folder = checkpoint.resolve().parent.parent
        for name in TOKENIZER_FILES:
            if (run_folder / name).is_file():
                shutil.copy2(run_folder / name, out / name)
    return out / WEIGHTS_FILE


def _check_is_checkpoint(path: Path) -> None:
    """A missing path, or a run folder (or its ``checkpoints/``) given instead of one of its checkpoints, in
    merge's words: verify_checkpoint's are ``--resume``'s."""
    from acceltrain.checkpoint.files import COMPLETE_FILE, complete_checkpoints
    from acceltrain.runtime.run_folder import CHECKPOINTS_DIR

    if not path.is_dir():
        raise ConfigError(f"CHECKPOINT {str(path)!r}: no such checkpoint folder")
    folder = path.resolve()
    if (folder / COMPLETE_FILE).exists():
        return
    if (folder / CHECKPOINTS_DIR).is_dir():
        run_folder = folder
    elif folder.name == CHECKPOINTS_DIR:
        run_folder = folder.parent
    else:
        return
    found = complete_checkpoints(run_folder)
    what = "a run folder" if run_folder == folder else "the checkpoints folder of a run"
    newest = f"its newest checkpoint is {str(found[-1])!r}" if found else "it has no complete checkpoint"
    raise ConfigError(f"CHECKPOINT {str(path)!r} is {what}, not a checkpoint: {newest}")


@contextlib.contextmanager
def _left_as_found(out: Path):
    """``out`` (new or empty) is made for the merge; whatever fails, it is left as it was: nothing half-written."""
    made = [folder for folder in (out, *out.parents) if not folder.exists()]
    out.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        if made:
            shutil.rmtree(made[-1], ignore_errors=True)
        else:
            for path in out.iterdir():
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        raise


def _described(checkpoint: Path, name: str) -> Path | None:
    """The file ``name`` that describes the checkpoint's model: the one the run wrote beside its checkpoints,
    else the run folder's (a finished run's, or one written before runs described their checkpoints)."""
    checkpoints = checkpoint.resolve().parent
    return next((folder / name for folder in (checkpoints, checkpoints.parent) if (folder / name).is_file()), None)


def _write_described(tensors: dict, checkpoint: Path, out: Path) -> None:
    """The weights beside their ``config.json`` (and generation config), once they are exactly those of the model
    that config builds: tied weights under each of their names, as the run folder holds them."""
    from acceltrain.hf.hub import model_skeleton, weights_mismatch
    from acceltrain.runtime.run_folder import CONFIG_FILE, GENERATION_CONFIG_FILE
    from acceltrain.train.export import save_tensors

    for name in (CONFIG_FILE, GENERATION_CONFIG_FILE):
        found = _described(checkpoint, name)
        if found is not None:
            shutil.copy2(found, out / name)
    skeleton = model_skeleton(out)
    tensors = _with_tied_names(tensors, skeleton)
    problem = weights_mismatch(skeleton, {name: tuple(tensor.shape) for name, tensor in tensors.items()})
    if problem:
        raise ConfigError(
            f"checkpoint {str(checkpoint)!r} holds weights that would not load into the model of "
            f"{_described(checkpoint, CONFIG_FILE)} ({problem}): a checkpoint of another model? Merge "
            "it in its own run folder"
        )
    save_tensors(tensors, out)


def _with_tied_names(tensors: dict, skeleton) -> dict:
    """``tensors`` with every name of a weight the model ties: Accelerate's checkpoints keep one (safetensors holds
    no shared tensors), the run folder each, as copies (:mod:`acceltrain.train.export`)."""
    names_of: dict[int, list[str]] = {}
    for name, tensor in skeleton.state_dict(keep_vars=True).items():
        names_of.setdefault(id(tensor), []).append(name)
    tied = dict(tensors)
    for names in names_of.values():
        kept = next((name for name in names if name in tensors), None)
        for name in names if kept is not None else ():
            tied.setdefault(name, tensors[kept].clone())
    return tied


def _merge_adapter(tensors: dict, checkpoint: Path, out: Path) -> None:
    """A LoRA run's weights merged into its base model (loaded from the folder its adapter_config.json names, with
    the config training gave it), written with ``save_pretrained`` and checked as :func:`acceltrain.load_model`
    checks a folder."""
    from peft import PeftConfig, get_peft_model
    from transformers import AutoConfig
    from transformers.utils import logging as transformers_logging

    from acceltrain.hf.hub import check_matches, model_skeleton, transformers_class
    from acceltrain.runtime.network import load_local_or_hub, one_line
    from acceltrain.runtime.run_folder import ADAPTER_CONFIG_FILE, CONFIG_FILE, WEIGHTS_FILE
    from acceltrain.train.export import _on_cpu

    where = f"checkpoint {str(checkpoint)!r}"
    adapter_file, config_file = _described(checkpoint, ADAPTER_CONFIG_FILE), _described(checkpoint, CONFIG_FILE)
    if adapter_file is None or config_file is None:
        found = {ADAPTER_CONFIG_FILE: adapter_file, CONFIG_FILE: config_file}
        lacking = " and ".join(name for name, path in found.items() if path is None)
        raise ConfigError(
            f"{where} holds a LoRA adapter's weights (peft names) and no {lacking} beside its "
            "checkpoints or in its run folder describes its model (an earlier acceltrain wrote none): "
            "merge the run's final adapter folder with peft "
            "(AutoPeftModelFor....from_pretrained(RUN).merge_and_unload())"
        )
    adapter = PeftConfig.from_pretrained(str(adapter_file.parent))
    adapter.inference_mode = False  # its weights trainable: those the checkpoint must hold
    config = AutoConfig.from_pretrained(config_file.parent)
    model_class = transformers_class(config, config_file.parent)
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # the base lacks a new head: its random start is replaced here
    try:
        base = load_local_or_hub(
            lambda path: model_class.from_pretrained(path, config=config),
            adapter.base_model_name_or_path,
            f"{where} holds a LoRA adapter for the base model",
            "a model",
        )
    finally:
        transformers_logging.set_verbosity(verbosity)
    model = get_peft_model(base, adapter)

    def other(why: str) -> ConfigError:
        return ConfigError(
            f"{where} holds other weights than the LoRA adapter {adapter_file} describes ({why}): a "
            "checkpoint of another run? Merge it in its own run folder"
        )

    try:
        unexpected = model.load_state_dict(tensors, strict=False).unexpected_keys
    except RuntimeError as err:  # a weight of another shape
        raise other(one_line(err)) from None
    missing = {name for name, param in model.named_parameters() if param.requires_grad} - tensors.keys()
    if unexpected or missing:
        raise other(f"{len(unexpected)} unexpected, {len(missing)} of the adapter's missing")
    merged = model.merge_and_unload()
    merged.save_pretrained(out, state_dict=_on_cpu(merged.state_dict()))
    check_matches(model_skeleton(out), out / WEIGHTS_FILE)


def _check_one_process() -> None:
    """Merge has no work to share, and several processes merging into one OUT race (each finds it no longer empty,
    or the launcher stops one mid-write): refused from the launcher's environment, before any process group."""
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    if processes > 1:
        raise ConfigError(
            f"acceltrain merge runs on one process (FSDP's shards included) and the launcher started "
            f"WORLD_SIZE={processes}: run it without torchrun or accelerate launch"
        )


def main(argv: list[str] | None = None) -> int:
    from acceltrain.config.parser import OneLineParser
    from acceltrain.runtime.preemption import EXIT_BAD_INPUT, give_the_main_process_time_to_print, report_error
    from acceltrain.runtime.run_folder import CONFIG_FILE

    parser = OneLineParser(prog="acceltrain merge", description=__doc__, allow_abbrev=False)
    parser.add_argument("checkpoint", help="a checkpoint folder, e.g. runs/NAME/checkpoints/step_00001000")
    parser.add_argument("out", help="a new folder for model.safetensors, its config and the run's tokenizer files")
    try:
        args = parser.parse_args(argv)
        _check_one_process()
        weights = merge(Path(args.checkpoint), Path(args.out))
    except ConfigError as err:
        report_error(str(err))  # once, from the main process, when a launcher started several
        give_the_main_process_time_to_print()
        return EXIT_BAD_INPUT
    alone = (
        ""
        if (weights.parent / CONFIG_FILE).is_file()
        else (
            f", without a {CONFIG_FILE}: no config describes the checkpoint's model (a module its recipe builds: load "
            "the weights into it)"
        )
    )
    print(f"wrote {weights}{alone}")
    return 0
