"""``acceltrain.load_model`` on run folders as the recipes write them, and on hostile or careless edits
of them: it works in a fresh process, and every config.json or model.safetensors that does not make
the trained model is one ConfigError line naming the file, before anything large is allocated."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, reset_accelerate_state, subprocess_env
from safetensors.torch import load_file, save_file
from test_causal_lm import SMALL, offline_on_one_thread, write_text
from test_hub import run_cifar

import acceltrain.hf.hub
from acceltrain import ConfigError, load_model

IMAGE_BUILDER = "acceltrain.vision.build_model"
RUN_FILES = ("config.json", "generation_config.json", "model.safetensors")


@pytest.fixture(scope="module")
def image_run(tmp_path_factory) -> Path:
    """A real resnet_cifar run: 2 steps of resnet_tiny on synthetic images."""
    out = tmp_path_factory.mktemp("image") / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "disabled")
        assert run_cifar(out, monkeypatch=patch) == 0
    reset_accelerate_state()
    return out


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory) -> Path:
    """A real causal_lm run: 2 steps of gpt2-tiny on a 300-token BPE."""
    sys.path.insert(0, str(REPO / "recipes"))
    import causal_lm

    from acceltrain import run_recipe

    root = tmp_path_factory.mktemp("lm")
    out, text = root / "run", write_text(root / "plays.txt")
    argv = ["--output-dir", str(out), *SMALL, "--text-files", str(text), "--batch-size", "8", "--max-steps", "2"]
    with offline_on_one_thread(root / "hf"), pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "disabled")
        patch.setattr(sys, "argv", ["recipes/causal_lm.py", *argv])
        reset_accelerate_state()
        run_recipe(causal_lm.main, causal_lm.CausalLMConfig, argv)
    reset_accelerate_state()
    return out


def copy_run(source: Path, target: Path, config=None, weights=None) -> Path:
    """The loadable files of ``source`` in ``target``; ``config(dict)`` and ``weights(dict)`` edit them in place."""
    target.mkdir()
    for name in RUN_FILES:
        if (source / name).exists():
            shutil.copy(source / name, target / name)
    if config is not None:
        settings = json.loads((target / "config.json").read_text())
        config(settings)
        (target / "config.json").write_text(json.dumps(settings))
    if weights is not None:
        tensors = load_file(str(target / "model.safetensors"))
        weights(tensors)
        save_file(tensors, str(target / "model.safetensors"))
    return target


def refused(folder: Path, message: str) -> str:
    """load_model's one-line ConfigError, which must contain ``message``."""
    with pytest.raises(ConfigError) as caught:
        load_model(folder)
    text = str(caught.value)
    assert message in text and "\n" not in text, text
    return text


@pytest.mark.slow
def test_image_and_language_model_folders_load_in_a_fresh_process(image_run, lm_run):
    """The builder registry used to fill only when acceltrain.vision.models had been imported: every image
    folder failed in a new process with ``names builder 'acceltrain.vision.build_model'; known:`` (empty)."""
    code = (
        "import sys, torch, acceltrain\n"
        "from safetensors.torch import load_file\n"
        "for folder in sys.argv[1:]:\n"
        "    model, saved = acceltrain.load_model(folder), load_file(folder + '/model.safetensors')\n"
        "    assert all(torch.equal(tensor, saved[name]) for name, tensor in model.state_dict().items()), folder\n"
        "    print(type(model).__name__, model.training)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(image_run), str(lm_run)],
        env=subprocess_env(HF_HUB_OFFLINE="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:2] == ["TinyResNet False", "GPT2LMHeadModel False"]


def test_every_module_with_a_loadable_builder_is_imported_by_load_model():
    """A new @loadable builder in a module load_model does not import would fail only in a fresh process."""
    package = Path(acceltrain.__file__).parent
    defining = {
        ".".join(path.relative_to(package.parent).with_suffix("").parts)
        for path in package.rglob("*.py")
        if "\n@loadable(" in path.read_text()
    }
    assert defining and defining <= set(acceltrain.hf.hub.LOADABLE_MODULES)


def drop_first(tensors: dict) -> None:
    del tensors[sorted(tensors)[0]]


def add_extra(tensors: dict) -> None:
    tensors["extra.weight"] = torch.zeros(2)


def reshape_first(tensors: dict) -> None:
    name = sorted(tensors)[0]
    tensors[name] = torch.zeros(3, *tensors[name].shape)


@pytest.mark.parametrize("run", ["image_run", "lm_run"])
@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (drop_first, "model.safetensors does not match config.json: missing "),
        (add_extra, "model.safetensors does not match config.json: unexpected 'extra.weight'"),
        (reshape_first, "model.safetensors does not match config.json: of another shape "),
    ],
    ids=["missing", "unexpected", "shape"],
)
def test_weights_that_do_not_match_the_config_are_one_line(tmp_path, request, run, edit, message):
    """A language model used to load with random weights (Transformers only warns) and exit 0."""
    source = request.getfixturevalue(run)
    first = sorted(load_file(str(source / "model.safetensors")))[0]
    text = refused(copy_run(source, tmp_path / "edited", weights=edit), message)
    assert str(tmp_path / "edited" / "model.safetensors") in text
    assert edit is add_extra or repr(first) in text, "names the key"


def test_an_acceltrain_config_with_a_model_type_is_malformed(tmp_path, image_run):
    """It used to load as a random GPT-2: a stray model_type took the folder for a Transformers one."""
    folder = copy_run(image_run, tmp_path / "edited", config=lambda settings: settings.update(model_type="gpt2"))
    refused(
        folder,
        "config.json names both an acceltrain builder ('acceltrain.vision.build_model') and a Transformers "
        "model_type ('gpt2'): a run writes one or the other",
    )


def replace(settings: dict, new: dict) -> None:
    settings.clear()
    settings.update(new)


MALFORMED = [
    ([1, 2], "config.json is a JSON list, not an object"),
    ({"builder": {"a": 1}, "kwargs": {}}, "config.json names builder {'a': 1}; known: acceltrain.vision.build_model"),
    ({"builder": IMAGE_BUILDER}, "config.json 'kwargs' must be a JSON object of the builder's arguments, not missing"),
    (
        {"builder": IMAGE_BUILDER, "kwargs": [1]},
        "config.json 'kwargs' must be a JSON object of the builder's arguments, not a list",
    ),
    (
        {"builder": IMAGE_BUILDER, "kwargs": {"name": "resnet_tiny", "colour": "red"}},
        "unexpected keyword argument 'colour'",
    ),
    ({"builder": IMAGE_BUILDER, "kwargs": {}}, "missing 1 required positional argument: 'name'"),
    ({"builder": IMAGE_BUILDER, "kwargs": {"name": "nope"}}, "--model 'nope' is invalid"),
    (
        {"builder": IMAGE_BUILDER, "kwargs": {"name": "resnet_tiny", "num_classes": "ten"}},
        "does not build a model: TypeError",
    ),
    ({"library_name": "acceltrain"}, "config.json names neither an acceltrain builder nor a Transformers model_type"),
    ({"model_type": "nope"}, "config.json does not build a model: ValueError"),
    ({"model_type": ["gpt2"]}, "config.json does not build a model: "),
]


@pytest.mark.parametrize(
    ("config", "message"),
    MALFORMED,
    ids=[
        "list",
        "builder-dict",
        "no-kwargs",
        "kwargs-list",
        "unknown-kwarg",
        "missing-kwarg",
        "bad-name",
        "bad-type",
        "neither",
        "unknown-model-type",
        "model-type-list",
    ],
)
def test_a_malformed_config_json_is_one_line(tmp_path, image_run, config, message):
    """These used to be raw AttributeError / TypeError / KeyError tracebacks."""
    folder = copy_run(image_run, tmp_path / "edited")
    (folder / "config.json").write_text(json.dumps(config))
    text = refused(folder, message)
    assert str(folder) in text


def test_a_language_model_too_big_for_memory_is_refused_before_building(tmp_path, lm_run):
    """n_layer and n_embd of 100000 used to allocate for minutes (1.2e16 parameters)."""
    folder = copy_run(
        lm_run, tmp_path / "edited", config=lambda settings: settings.update(n_layer=100_000, n_embd=100_000)
    )
    refused(folder, "config.json describes a model of more than ")


def test_an_image_model_too_big_for_memory_is_refused_before_building(tmp_path, image_run):
    folder = copy_run(
        image_run, tmp_path / "edited", config=lambda settings: settings["kwargs"].update(num_classes=10**12)
    )
    refused(folder, "config.json describes a model of more than ")


def test_the_size_refusal_names_the_size_and_the_limit(image_run, monkeypatch):
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Memory", (), {"available": 100_000})())
    refused(image_run, "KB (parameters and buffers) but 97.66 KB of memory is available")


def test_a_path_that_is_no_folder_is_one_line(tmp_path):
    """It used to go to the Hub as a repo name: a raw HFValidationError."""
    with pytest.raises(ConfigError, match=r"^load_model '.*/missing': no such file or folder$"):
        load_model(tmp_path / "missing")


@pytest.mark.parametrize("weights", [None, b"not safetensors"], ids=["missing", "corrupt"])
def test_weights_that_are_missing_or_unreadable_are_one_line(tmp_path, image_run, weights):
    """They used to be a raw FileNotFoundError / SafetensorError from safetensors."""
    folder = copy_run(image_run, tmp_path / "edited")
    (folder / "model.safetensors").unlink()
    if weights is not None:
        (folder / "model.safetensors").write_bytes(weights)
    refused(folder, f"{folder / 'model.safetensors'} is not a readable safetensors file (")
