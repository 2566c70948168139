"""Hub-ready run folders: one call loads the trained model back, a model card, the resolved settings as a
preset, generation_config.json for language models, and --push-to-hub against stand-ins of the Hub API
(the repo checked before the first step, one line when pushing cannot work); for any Transformers model the
card's Auto class of its head, and no folder whose weights would load as random. No network: the Hub is a
local stand-in server or monkeypatched HfApi methods."""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from conftest import RECIPE, read_summary, reset_accelerate_state
from huggingface_hub import HfApi

import acceltrain.hooks.hub
import acceltrain.train.loop
from acceltrain import ConfigError, Hook, TrainConfig, parse_config, run_recipe
from acceltrain.config.train_config import run_changes
from acceltrain.hf.hub import load_model
from acceltrain.hf.model_card import NOT_REPRODUCED

sys.path.insert(0, str(RECIPE.parent))
import causal_lm  # noqa: E402
from resnet_cifar import CifarConfig  # noqa: E402
from resnet_cifar import main as cifar_main

TOKEN = "hf_acceltraintesttoken0123456789abcdef"
REAL_CREATE_REPO = HfApi.create_repo  # before any test replaces it
TINY_CIFAR = [
    "--dataset",
    "synthetic",
    "--model",
    "resnet_tiny",
    "--batch-size",
    "16",
    "--max-steps",
    "2",
    "--report-to",
    "none",
    "--no-progress",
    "--num-workers",
    "0",
]


class Recorder(Hook):
    """Notes each optimizer step in ``events`` and keeps the trained model for comparison."""

    def __init__(self, events: list):
        self.events = events

    def on_step_end(self, run):
        self.events.append("step")

    def on_fit_end(self, run, summary):
        self.model = run.accelerator.unwrap_model(run.model).eval()


@pytest.fixture
def hub_hooks(monkeypatch):
    """The built-in hooks (HubReady last) plus a Recorder first; yields (events, recorder)."""
    events: list = []
    recorder = Recorder(events)
    builtin = acceltrain.train.loop.builtin_hooks
    monkeypatch.setattr(
        acceltrain.train.loop, "builtin_hooks", lambda cfg, **kwargs: [recorder, *builtin(cfg, **kwargs)]
    )
    return events, recorder


def run_cifar(output_dir: Path, *args: str, monkeypatch) -> int:
    argv = [*TINY_CIFAR, "--output-dir", str(output_dir), *args]
    monkeypatch.setattr(sys, "argv", ["recipes/resnet_cifar.py", *argv])  # the command the card records
    reset_accelerate_state()
    try:
        run_recipe(cifar_main, CifarConfig, argv)
    except SystemExit as stop:
        return stop.code
    return 0


@pytest.fixture(scope="module")
def fixed_images():
    return torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def test_a_resnet_run_folder_loads_with_one_call_and_describes_itself(tmp_path, hub_hooks, monkeypatch):
    out = tmp_path / "run"
    assert run_cifar(out, "--ema-decay", "0.9", monkeypatch=monkeypatch) == 0
    loaded = load_model(out)
    assert type(loaded).__name__ == "TinyResNet" and not loaded.training
    from safetensors.torch import load_file  # with --ema-decay: the averaged weights, as exported

    exported = load_file(str(out / "model.safetensors"))
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, exported[name], rtol=0, atol=0, msg=name)
    config = json.loads((out / "config.json").read_text())
    assert config["builder"] == "acceltrain.vision.build_model"
    assert config["kwargs"] == {"name": "resnet_tiny", "num_classes": 10, "stem": "cifar"}

    card = (out / "README.md").read_text()
    summary = read_summary(out)
    assert (
        card.startswith("---\n") and "library_name: acceltrain" in card and "pipeline_tag: image-classification" in card
    )
    assert "acceltrain.vision.build_model(name='resnet_tiny', num_classes=10, stem='cifar')" in card  # model
    assert (
        "| dataset | synthetic |" in card and "training samples: 2048" in card and "evaluation samples: 512" in card
    )  # data
    assert "| lr | 0.1 |" in card and "| batch_size | 16 |" in card and "| ema_decay | 0.9 |" in card  # settings
    assert f"| eval_accuracy | {summary['eval_accuracy']:.6g} |" in card and "| steps | 2 |" in card  # final metrics
    assert f"| device | {summary['runtime']['device_name']} |" in card and "| processes | 1 |" in card  # hardware
    assert "python recipes/resnet_cifar.py --dataset synthetic --model resnet_tiny" in card  # the command
    assert 'load_model("' in card


@pytest.mark.parametrize(
    "argv0,module,command",
    [
        ("recipes/resnet_cifar.py", None, ["python", "recipes/resnet_cifar.py"]),
        (
            "/venv/lib/acceltrain/recipes/resnet_cifar.py",
            "acceltrain.recipes.resnet_cifar",
            ["python", "-m", "acceltrain.recipes.resnet_cifar"],
        ),
        (f"{sysconfig.get_path('scripts')}/acceltrain-resnet-cifar", None, ["acceltrain-resnet-cifar"]),
        ("myrecipe", None, ["python", "myrecipe"]),  # a script without .py, or a folder with __main__.py
    ],
)
def test_the_card_s_command_is_the_one_the_user_typed(monkeypatch, argv0, module, command):
    """Under -m or a console script the card used to say ``python /full/path/...``, which runs nothing useful."""
    import types

    from acceltrain.hf.model_card import launch_command

    main = types.ModuleType("__main__")
    main.__file__, main.__spec__ = argv0, (types.SimpleNamespace(name=module) if module else None)
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", [argv0, "--lr", "0.1"])
    assert launch_command() == command


@pytest.mark.slow
def test_the_loaded_model_gives_the_trained_model_s_outputs(tmp_path, hub_hooks, monkeypatch, fixed_images):
    _, recorder = hub_hooks
    out = tmp_path / "run"
    assert run_cifar(out, monkeypatch=monkeypatch) == 0
    with torch.no_grad():
        torch.testing.assert_close(load_model(str(out))(fixed_images), recorder.model(fixed_images), rtol=0, atol=0)


def test_train_config_yaml_reproduces_the_run_s_settings(tmp_path, hub_hooks, monkeypatch):
    out = tmp_path / "run"
    assert run_cifar(out, "--lr", "0.05", "--label-smoothing", "0.1", monkeypatch=monkeypatch) == 0
    again = parse_config(CifarConfig, ["--config", str(out / "train_config.yaml")])
    assert run_changes(read_summary(out)["config"], again) == {}, "same maths"
    assert (again.lr, again.label_smoothing, again.output_dir) == (0.05, 0.1, None)
    assert not set(NOT_REPRODUCED) & set((out / "train_config.yaml").read_text().split(":"))


def test_load_model_runs_no_builder_outside_the_allow_list(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"builder": "os.system", "kwargs": {"command": "touch pwned"}}))
    with pytest.raises(ConfigError, match=r"names builder 'os.system'; known: acceltrain.vision.build_model"):
        load_model(tmp_path)
    assert not Path("pwned").exists()


def test_a_causal_lm_folder_gets_generation_config_and_a_card(tmp_path, hub_hooks, monkeypatch):
    from test_causal_lm import SMALL, offline_on_one_thread, write_text
    from transformers import GenerationConfig

    out = tmp_path / "run"
    text = write_text(tmp_path / "plays.txt")
    argv = ["--output-dir", str(out), *SMALL, "--text-files", str(text), "--batch-size", "8", "--max-steps", "2"]
    monkeypatch.setattr(sys, "argv", ["recipes/causal_lm.py", *argv])
    with offline_on_one_thread(tmp_path / "hf"):
        reset_accelerate_state()
        run_recipe(causal_lm.main, causal_lm.CausalLMConfig, argv)
        generation = GenerationConfig.from_pretrained(out)
        model = load_model(out)
    tokenizer_eos = json.loads((out / "config.json").read_text())["eos_token_id"]
    assert generation.eos_token_id == tokenizer_eos is not None
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert json.loads((out / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    card = (out / "README.md").read_text()
    assert "library_name: transformers" in card and "pipeline_tag: text-generation" in card
    assert "AutoModelForCausalLM.from_pretrained" in card and "| model | gpt2-tiny |" in card and "text_files" in card
    assert "| eval_loss |" in card and "python recipes/causal_lm.py --output-dir" in card


# --------------------------------------------------------------------------- --push-to-hub


@pytest.fixture
def hub_stand_in(monkeypatch):
    """A Hub that answers (a local HTTP server for the reachability check), a token, and HfApi's
    create_repo/upload_folder replaced by recorders; yields the list of calls."""
    import http.server
    import threading

    import huggingface_hub.constants
    from huggingface_hub.utils import filter_repo_objects

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    calls: list = []

    def create_repo(self, repo_id, *, private=None, exist_ok=False, **kwargs):
        calls.append(("create_repo", repo_id, private, exist_ok))
        return type("RepoUrl", (), {"repo_id": repo_id if "/" in repo_id else f"someone/{repo_id}"})()

    def upload_folder(self, *, repo_id, folder_path, allow_patterns, ignore_patterns, commit_message, **kwargs):
        files = sorted(str(p.relative_to(folder_path)) for p in Path(folder_path).rglob("*") if p.is_file())
        uploaded = sorted(filter_repo_objects(files, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns))
        calls.append(("upload_folder", repo_id, uploaded, commit_message))
        return type("CommitInfo", (), {"commit_url": f"https://hub.example/{repo_id}/commit/abc"})()

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    yield calls
    server.shutdown()


def test_push_to_hub_creates_the_repo_before_training_and_uploads_the_folder(
    tmp_path, hub_hooks, monkeypatch, hub_stand_in, capsys
):
    events, _ = hub_hooks
    monkeypatch.setattr(
        acceltrain.hooks.hub, "prepare_repo", _recording(acceltrain.hooks.hub.prepare_repo, events, "repo ready")
    )
    out = tmp_path / "run"
    assert (
        run_cifar(
            out,
            "--push-to-hub",
            "--hub-model-id",
            "someone/tiny-cifar",
            "--hub-private",
            "--save-every-steps",
            "1",
            monkeypatch=monkeypatch,
        )
        == 0
    )
    assert events[0] == "repo ready" and events.count("step") == 2, "checked and created before the first step"
    (create, upload) = hub_stand_in
    assert create == ("create_repo", "someone/tiny-cifar", True, True)
    _, repo_id, uploaded, message = upload
    assert repo_id == "someone/tiny-cifar" and message.startswith("acceltrain run run: 2 steps, eval_accuracy ")
    assert {
        "README.md",
        "config.json",
        "model.safetensors",
        "summary.json",
        "train_config.yaml",
        "metrics.jsonl",
    } <= set(uploaded)
    assert not [name for name in uploaded if "/" in name or name == ".lock"], "no checkpoints, no lock"
    summary = read_summary(out)
    assert summary["hub_commit"] == "https://hub.example/someone/tiny-cifar/commit/abc"
    assert "pushed " in capsys.readouterr().out
    assert 'load_model("someone/tiny-cifar")' in (out / "README.md").read_text()
    for file in out.rglob("*"):
        if file.is_file():
            assert TOKEN.encode() not in file.read_bytes(), file


def _recording(function, events: list, name: str):
    def recorded(*args, **kwargs):
        result = function(*args, **kwargs)
        events.append(name)
        return result

    return recorded


def test_a_failed_upload_keeps_the_finished_run_and_says_how_to_upload_later(
    tmp_path, hub_hooks, monkeypatch, hub_stand_in, capsys
):
    def broken_upload(self, **kwargs):
        raise OSError("connection reset by peer")

    monkeypatch.setattr(HfApi, "upload_folder", broken_upload)
    out = tmp_path / "run"
    assert run_cifar(out, "--push-to-hub", monkeypatch=monkeypatch) == 0
    summary = read_summary(out)
    assert summary["hub_push_error"] == "OSError: connection reset by peer" and summary["steps"] == 2
    printed = capsys.readouterr().out
    assert f"upload it with `hf upload someone/run {out} --exclude '*/*'`" in printed


def no_token(monkeypatch):
    import huggingface_hub

    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)


def offline_hub(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def unreachable_hub(monkeypatch):
    import socket

    import huggingface_hub.constants

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{port}")


def rejected_token(monkeypatch):
    """The real create_repo against a server that answers 401."""
    import http.server
    import threading

    import huggingface_hub.constants

    class Unauthorized(http.server.BaseHTTPRequestHandler):
        def _answer(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = b'{"error": "Invalid credentials in Authorization header"}'
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Unauthorized)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setattr(HfApi, "create_repo", REAL_CREATE_REPO)


IMPOSSIBLE_PUSHES = [
    (no_token, "--push-to-hub needs a Hugging Face token with write access: `hf auth login` or HF_TOKEN"),
    (offline_hub, "--push-to-hub cannot work with HF_HUB_OFFLINE set"),
    (unreachable_hub, "the Hugging Face Hub at http://127.0.0.1:"),
    (rejected_token, "rejected the token (check it: `hf auth whoami`)"),
]


@pytest.mark.parametrize(
    ("make_impossible", "message"), IMPOSSIBLE_PUSHES, ids=[p[0].__name__ for p in IMPOSSIBLE_PUSHES]
)
def test_push_that_cannot_work_is_one_line_before_training(
    tmp_path, hub_hooks, monkeypatch, hub_stand_in, capsys, make_impossible, message
):
    events, _ = hub_hooks
    make_impossible(monkeypatch)
    out = tmp_path / "run"
    assert run_cifar(out, "--push-to-hub", monkeypatch=monkeypatch) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err, err
    assert "upload it later with `hf upload REPO RUN_DIR --exclude '*/*'`" in err
    assert "step" not in events and not out.exists(), (
        "refused before training, nothing left behind (no .lock, no metrics.jsonl)"
    )
    assert TOKEN not in err


def test_a_push_refused_in_an_existing_folder_leaves_it_as_it_was(
    tmp_path, hub_hooks, monkeypatch, hub_stand_in, capsys
):
    offline_hub(monkeypatch)
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert run_cifar(out, "--push-to-hub", monkeypatch=monkeypatch) == 2
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("flag", [["--hub-model-id", "someone/x"], ["--hub-private"]])
def test_hub_settings_need_push_to_hub(flag):
    with pytest.raises(ConfigError, match=f"{flag[0]} needs --push-to-hub"):
        parse_config(CifarConfig, flag)


def test_an_invalid_repo_id_is_one_line(tmp_path, hub_hooks, monkeypatch, hub_stand_in, capsys):
    assert run_cifar(tmp_path / "run", "--push-to-hub", "--hub-model-id", "a/b/c", monkeypatch=monkeypatch) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --hub-model-id 'a/b/c' is invalid: ") and "\n" not in err, err


# ------------------------------------------------------------------ folders of any Transformers model (issue 33 item 4)


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> Path:
    from test_causal_lm import offline_on_one_thread

    sys.path.insert(0, str(Path(__file__).parent / "helpers"))
    from pretrained_folders import bert_folder

    root = tmp_path_factory.mktemp("bert")
    with offline_on_one_thread(root / "hf"):
        return bert_folder(root / "bert")


def fit_classifier(output_dir: Path, model, hooks=()) -> dict:
    """``fit()`` as a user calls it: a Transformers classifier on a few tokenised sentences, padded per batch."""
    from transformers import AutoTokenizer

    from acceltrain import fit
    from acceltrain.text import TextClassificationTask, classification_batches
    from acceltrain.train.optim import build_optimizer

    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    examples = [{**tokenizer(text), "labels": label} for text, label in [("good film", 1), ("bad plot", 0)] * 8]
    cfg = parse_config(
        TrainConfig,
        [
            "--output-dir",
            str(output_dir),
            "--max-steps",
            "2",
            "--batch-size",
            "4",
            "--report-to",
            "none",
            "--no-progress",
            "--num-workers",
            "0",
            "--no-plots",
        ],
    )
    reset_accelerate_state()
    return fit(
        cfg,
        model,
        build_optimizer(model, cfg),
        examples,
        examples,
        task=TextClassificationTask(["neg", "pos"]),
        hooks=hooks,
        collate_fn=classification_batches(tokenizer),
    )


def test_the_card_names_the_auto_class_of_the_model_s_head():
    from transformers import BertConfig, GPT2Config, LlamaConfig

    from acceltrain.hf.auto_classes import auto_class

    cases = {
        (BertConfig, "BertForSequenceClassification"): ("AutoModelForSequenceClassification", "text-classification"),
        (BertConfig, "BertForTokenClassification"): ("AutoModelForTokenClassification", "token-classification"),
        (BertConfig, "BertForMaskedLM"): ("AutoModelForMaskedLM", "fill-mask"),
        (BertConfig, "BertModel"): ("AutoModel", "feature-extraction"),
        (GPT2Config, "GPT2LMHeadModel"): ("AutoModelForCausalLM", "text-generation"),
        (GPT2Config, "GPT2ForSequenceClassification"): ("AutoModelForSequenceClassification", "text-classification"),
        (LlamaConfig, "LlamaForCausalLM"): ("AutoModelForCausalLM", "text-generation"),
    }
    for (config_class, architecture), expected in cases.items():
        assert auto_class(config_class(architectures=[architecture])) == expected, architecture
    assert auto_class(BertConfig(architectures=["MyBertHead"])) is None


def test_a_classifier_folder_loads_with_load_model_by_its_head_and_an_unknown_adapter_is_one_line(tmp_path, bert):
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "run"
    fit_classifier(out, AutoModelForSequenceClassification.from_pretrained(bert, num_labels=2))
    assert type(load_model(out)).__name__ == "BertForSequenceClassification"
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"an adapter of task type None, which loads with none of peft's "):
        load_model(tmp_path / "adapter")  # a run's adapter folder loads (test_fine_tuning_usability)


def test_a_model_whose_weights_would_load_as_random_is_refused_before_training(tmp_path, bert):
    """A head replaced after loading: from_pretrained would find none of its weights and initialise it, warning only."""
    from torch import nn
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(bert, num_labels=2)
    model.classifier = nn.Sequential(nn.Dropout(0.1), nn.Linear(32, 2))
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as caught:
        fit_classifier(out, model)
    assert str(caught.value) == (
        "the BertForSequenceClassification's weights would not load into the model its own config.json builds, so "
        "from_pretrained would leave them random: missing 'classifier.bias', 'classifier.weight'; unexpected "
        "'classifier.1.bias', 'classifier.1.weight'; keep its modules as its config builds them"
    )
    assert not out.exists(), "refused before training, nothing written"


class RenamedExport(Hook):
    """Asks for final weights under other names than the model's (a hook's bug): the folder must not claim them."""

    def on_train_end(self, run):
        model = run.accelerator.unwrap_model(run.model)
        run.request_export({f"backbone.{name}": tensor for name, tensor in model.state_dict().items()})


def test_weights_that_would_load_as_random_are_kept_without_a_config_at_save_time(tmp_path, bert):
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "run"
    with pytest.raises(
        ConfigError,
        match=r"missing 'bert.embeddings.LayerNorm.bias', .*; unexpected 'backbone.bert.*the trained "
        r"weights are kept in .*model.safetensors, without a config.json$",
    ):
        fit_classifier(
            out, AutoModelForSequenceClassification.from_pretrained(bert, num_labels=2), hooks=[RenamedExport()]
        )
    assert (
        "backbone.classifier.weight" in load_file(str(out / "model.safetensors")) and not (out / "config.json").exists()
    )


def test_a_module_that_merely_carries_a_transformers_config_is_saved_as_a_module_of_its_own(tmp_path, bert):
    """Before: config.json of the inner model next to weights named after the wrapper, loading as a random model."""
    from torch import nn
    from transformers import AutoModelForSequenceClassification

    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config, self.name_or_path = inner, inner.config, inner.name_or_path

        def forward(self, **batch):
            return self.inner(**batch)

    out = tmp_path / "run"
    fit_classifier(out, Wrapper(AutoModelForSequenceClassification.from_pretrained(bert, num_labels=2)))
    assert (out / "model.safetensors").exists() and not (out / "config.json").exists()
    assert "built by the recipe (no registered builder" in (out / "README.md").read_text()


def test_the_card_names_the_model_s_own_class_under_fsdp2():
    """FSDP2 gives a sharded module a class of its own (FSDPGPT2LMHeadModel, in torch.distributed): the card used to
    tell users to import that."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from acceltrain.hf.hub import model_head, own_class

    sharded_class = type(
        "FSDPGPT2LMHeadModel", (GPT2LMHeadModel,), {"__module__": "torch.distributed.fsdp._fully_shard._fsdp_init"}
    )
    model = sharded_class(GPT2Config(vocab_size=8, n_positions=4, n_embd=4, n_layer=1, n_head=1))
    assert own_class(model) is GPT2LMHeadModel and model_head(model) == ("AutoModelForCausalLM", "text-generation")
