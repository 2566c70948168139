"""LoRA through peft for fit() users and both recipes (issue 33 item 3): the option group, apply_lora's modules
trained in full (found with or without the loading info), target modules checked, the docs' fit() example, two
processes equal to one at twice the batch, and the backends refused in one line. Offline, one thread."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, check, docs_example, launch, read_summary
from safetensors.torch import load_file
from test_causal_lm import offline_on_one_thread

from acceltrain import ConfigError, LoraOptions, TrainConfig, apply_lora, parse_config

sys.path.insert(0, str(REPO / "recipes"))
sys.path.insert(0, str(REPO / "tests" / "helpers"))
import text_classification  # noqa: E402
from in_process import run_in_process  # noqa: E402
from pretrained_folders import bert_folder, reviews, write_rows  # noqa: E402

TINY = [
    "--lr",
    "5e-3",
    "--max-length",
    "48",
    "--num-workers",
    "0",
    "--num-proc",
    "1",
    "--no-progress",
    "--report-to",
    "none",
    "--no-plots",
    "--log-every",
    "2",
    "--lora-r",
    "4",
    "--max-steps",
    "4",
    "--eval-every",
    "4",
]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("lora")
    with offline_on_one_thread(root / "hf"):
        bert = bert_folder(root / "bert")
    return SimpleNamespace(
        root=root,
        bert=bert,
        train=write_rows(root / "train.csv", reviews(96)),
        eval=write_rows(root / "eval.csv", reviews(32, seed=1)),
    )


@pytest.fixture(autouse=True)
def offline(data):
    with offline_on_one_thread(data.root / "hf"):
        yield


@dataclass
class Config(LoraOptions, TrainConfig):
    pass


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--merge-lora"], "--merge-lora needs --lora-r (the rank of the LoRA adapter to train)"),
        (["--lora-alpha", "16"], "--lora-alpha needs --lora-r"),
        (["--lora-target-modules", "q_proj"], "--lora-target-modules needs --lora-r"),
        (["--lora-r", "0"], "--lora-r 0 is invalid: must be an integer >= 1"),
        (["--lora-r", "8", "--lora-dropout", "1"], "--lora-dropout 1.0 is invalid: must be a number in [0, 1)"),
        (
            ["--lora-r", "8", "--lora-target-modules", ","],
            "--lora-target-modules ',' is invalid: must be module names, or all-linear",
        ),
    ],
)
def test_the_option_group_refuses_settings_that_cannot_work(argv, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        parse_config(Config, argv)


def classifier(data):
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(data.bert, num_labels=2, output_loading_info=True)


def in_full(model) -> list[str]:
    return sorted(
        name.removeprefix("base_model.model.")
        for name, module in model.named_modules()
        if type(module).__name__ == "ModulesToSaveWrapper"
    )


def test_what_the_checkpoint_lacks_is_trained_in_full_found_with_or_without_the_loading_info(data):
    """The masked-LM checkpoint has no pooler: frozen, it would reload random and the adapter predict otherwise."""
    options = parse_config(Config, ["--lora-r", "4"])
    model, loading = classifier(data)
    with_info = apply_lora(model, options, missing_keys=loading["missing_keys"])
    without_info = apply_lora(classifier(data)[0], options)  # loads the base again to find them
    assert in_full(with_info) == in_full(without_info) == ["bert.pooler", "classifier"]
    trainable = sorted(name for name, param in with_info.named_parameters() if param.requires_grad)
    assert trainable == sorted(name for name, param in without_info.named_parameters() if param.requires_grad)
    assert not [name for name in trainable if "pooler" in name and "lora" in name], (
        "no adapter inside a module trained in full"
    )
    assert with_info.peft_config["default"].base_model_name_or_path == str(data.bert.resolve())


def test_a_model_not_loaded_from_a_checkpoint_is_refused():
    from transformers import BertConfig, BertForSequenceClassification

    model = BertForSequenceClassification(
        BertConfig(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=1, intermediate_size=8)
    )
    with pytest.raises(
        ConfigError, match="was not loaded with from_pretrained, so no checkpoint holds its base weights"
    ):
        apply_lora(model, parse_config(Config, ["--lora-r", "4"]))


def test_backends_that_cannot_train_or_write_an_adapter_are_refused():
    from acceltrain.engines import DDP, FSDP2, DeepSpeed, OneProcess
    from acceltrain.hf.lora import check_backend

    with pytest.raises(ConfigError, match=r"^LoRA \(--lora-r\) is not supported under DeepSpeed here: .*; use DDP$"):
        check_backend(DeepSpeed, merge=False)
    with pytest.raises(ConfigError, match="^--merge-lora needs the whole weights on one process and FSDP shards them"):
        check_backend(FSDP2, merge=True)
    for engine in (OneProcess, DDP, FSDP2):
        check_backend(engine, merge=False)
    check_backend(DDP, merge=True)


def test_the_docs_fit_example_trains_an_adapter_that_keeps_the_new_head(tmp_path, data, capsys):
    namespace = docs_example("fine-tuning.md", "apply_lora(model, cfg")
    out = tmp_path / "run"
    assert (
        run_in_process(
            namespace["main"],
            namespace["SentimentConfig"],
            out,
            "--model-name-or-path",
            str(data.bert),
            "--lora-r",
            "4",
            "--max-steps",
            "2",
            "--batch-size",
            "8",
            "--optimizer",
            "adamw",
            "--lr",
            "1e-3",
            "--report-to",
            "none",
            "--no-progress",
            "--num-workers",
            "0",
        )
        == 0
    )
    saved = load_file(str(out / "adapter_model.safetensors"))
    assert "base_model.model.bert.pooler.dense.weight" in saved and "base_model.model.classifier.weight" in saved
    summary = read_summary(out)
    assert 0 < summary["trainable_parameters"] < summary["parameters"]
    assert "AutoPeftModelForSequenceClassification.from_pretrained" in (out / "README.md").read_text()
    start = capsys.readouterr().out
    assert "checkpoints: none scheduled" in start and "frozen base tensors" not in start, (
        "an adapter run that saves no checkpoint says nothing of what its checkpoints hold"
    )


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, data) -> Path:
    out = tmp_path_factory.mktemp("one") / "run"
    with offline_on_one_thread(data.root / "hf"):
        assert (
            run_in_process(
                text_classification.main,
                text_classification.TextClassificationConfig,
                out,
                *TINY,
                *source(data),
                "--batch-size",
                "16",
            )
            == 0
        )
    return out


def source(data) -> list[str]:
    return ["--model-name-or-path", str(data.bert), "--train-file", str(data.train), "--eval-file", str(data.eval)]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("config", ["multi_cpu.yaml", "fsdp_cpu.yaml"], ids=["ddp", "fsdp"])
def test_two_processes_train_the_adapter_of_one_process_at_twice_the_batch(tmp_path, data, one_process, config):
    """Under DDP, and under FSDP2 (issue 32): the adapter's and the new head's shards, the frozen base's too."""
    two = tmp_path / "two"
    check(
        launch(
            REPO / "recipes" / "text_classification.py",
            [*TINY, *source(data), "--batch-size", "8", "--output-dir", str(two)],
            processes=2,
            launcher="accelerate",
            config=config,
            HF_HUB_OFFLINE="1",
            HF_HOME=str(data.root / "hf" / "home"),
            HF_DATASETS_CACHE=str(data.root / "hf" / "datasets"),
        )
    )
    assert read_summary(two)["num_processes"] == 2
    assert read_summary(two)["distributed_type"] == ("FSDP" if config == "fsdp_cpu.yaml" else "MULTI_CPU")
    expected = load_file(str(one_process / "adapter_model.safetensors"))
    for name, tensor in load_file(str(two / "adapter_model.safetensors")).items():
        torch.testing.assert_close(tensor, expected[name], rtol=1e-4, atol=1e-6, msg=name)
    assert read_summary(two)["eval_accuracy"] == read_summary(one_process)["eval_accuracy"]


@pytest.mark.slow
def test_lora_under_deepspeed_is_one_line_before_any_work(tmp_path, data):
    pytest.importorskip("deepspeed")
    out = tmp_path / "ds"
    result = launch(
        REPO / "recipes" / "text_classification.py",
        [*TINY, "--model-name-or-path", str(data.bert), "--train-file", str(data.train), "--output-dir", str(out)],
        launcher="accelerate",
        config="deepspeed_zero2.yaml",
        HF_HUB_OFFLINE="1",
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert (
        result.returncode != 0 and len(errors) == 1 and "LoRA (--lora-r) is not supported under DeepSpeed" in errors[0]
    ), result.stderr[-2000:]
    assert not out.exists()


def test_an_unknown_target_module_lists_the_close_names_and_the_linear_layers(data):
    model, _ = classifier(data)
    with pytest.raises(ConfigError) as caught:
        apply_lora(model, parse_config(Config, ["--lora-r", "4", "--lora-target-modules", "qurey"]))
    assert str(caught.value) == (
        "--lora-target-modules 'qurey' is not a module of BertForSequenceClassification: close names: query, "
        "key; its linear layers to adapt: dense, key, query, value (or all-linear)"
    )


def test_a_target_module_trained_in_full_is_said_so(data):
    """Round 5 (issue 38, item 13): 'classifier' was "not a module", and then listed among the linear layers. It is the
    new head, which the checkpoint does not hold: trained in full and saved with the adapter, never adapted."""
    model, loading = classifier(data)
    with pytest.raises(ConfigError) as caught:
        apply_lora(
            model,
            parse_config(Config, ["--lora-r", "4", "--lora-target-modules", "query,classifier"]),
            missing_keys=loading["missing_keys"],
        )
    assert str(caught.value) == (
        "--lora-target-modules 'classifier' is trained in full, not adapted: the checkpoint of this "
        "BertForSequenceClassification does not hold it, so it is trained and saved whole with the adapter (peft's "
        "modules_to_save); its linear layers to adapt: dense, key, query, value (or all-linear)"
    )


def test_all_linear_adapts_every_linear_layer_but_the_head(data):
    model = apply_lora(
        classifier(data)[0], parse_config(Config, ["--lora-r", "2", "--lora-target-modules", "all-linear"])
    )
    targeted = model.base_model.targeted_module_names
    assert len(targeted) == 12 and not [name for name in targeted if "classifier" in name or "pooler" in name], targeted


def test_an_architecture_peft_has_no_default_targets_for_is_one_line(tmp_path):
    from transformers import AutoModelForSequenceClassification, SqueezeBertConfig, SqueezeBertForSequenceClassification

    config = SqueezeBertConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        embedding_size=32,
    )
    SqueezeBertForSequenceClassification(config).save_pretrained(tmp_path / "squeezebert")
    model, loading = AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "squeezebert", output_loading_info=True
    )
    with pytest.raises(
        ConfigError,
        match=r"^LoRA cannot adapt this SqueezeBertForSequenceClassification: Please specify `target_modules`.*"
        r"\(--lora-target-modules names the modules\)$",
    ):
        apply_lora(model, parse_config(Config, ["--lora-r", "4"]), missing_keys=loading["missing_keys"])


def test_lora_without_peft_installed_is_one_line(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *args: None if name == "peft" else find_spec(name, *args)
    )
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "--lora-r trains the adapter with peft, which is not installed: pip install 'acceltrain[peft]'"
        ),
    ):
        parse_config(Config, ["--lora-r", "8"])
