"""The text classification recipe on a tiny BERT made here (issue 33): full fine-tuning, a LoRA adapter and the
adapter merged, each run folder loaded in a fresh process and predicting what was trained; per-batch padding
and grouping by length (exact resume); the per-class report; one-line bad input. Offline, one thread."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, read_summary, subprocess_env
from safetensors import safe_open
from test_causal_lm import offline_on_one_thread

from acceltrain import ConfigError, parse_config
from acceltrain.runtime.preemption import EXIT_PREEMPTED

sys.path.insert(0, str(REPO / "recipes"))
sys.path.insert(0, str(REPO / "tests" / "helpers"))
import text_classification  # noqa: E402
from in_process import Predictions, recording, run_in_process  # noqa: E402
from pretrained_folders import bert_folder, reviews, write_rows  # noqa: E402

# 5e-3 trains this tiny BERT in a few dozen steps; 48 tokens cut a few of the longer reviews
TINY = [
    "--batch-size",
    "16",
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
    "8",
]


def run(output_dir: Path, *args: str) -> int:
    return run_in_process(text_classification.main, text_classification.TextClassificationConfig, output_dir, *args)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("classification")
    with offline_on_one_thread(root / "hf"):
        bert = bert_folder(root / "bert")
    eval_rows = reviews(48, seed=1, words=(3, 70))
    return SimpleNamespace(
        root=root,
        bert=bert,
        train=write_rows(root / "train.csv", reviews(192, seed=0)),
        eval=write_rows(root / "eval.csv", eval_rows),
        eval_texts=[row["text"] for row in eval_rows],
    )


@pytest.fixture(autouse=True)
def offline(data):
    with offline_on_one_thread(data.root / "hf"):
        yield


def source(data) -> list[str]:
    return ["--model-name-or-path", str(data.bert), "--train-file", str(data.train), "--eval-file", str(data.eval)]


@pytest.fixture(scope="module")
def runs(data) -> SimpleNamespace:
    """Three runs with the same seed and data: every weight trained, a LoRA adapter (peft's default targets), and
    the same adapter merged; with the logits each trained model gives the eval texts."""
    root = data.root / "runs"
    with offline_on_one_thread(data.root / "hf"), recording(Predictions(data.eval_texts)) as predictions:
        assert run(root / "full", *TINY, *source(data), "--max-steps", "60", "--eval-every", "30") == 0
        lora = [*TINY, *source(data), "--max-steps", "24", "--lora-r", "4"]
        assert run(root / "adapter", *lora) == 0
        assert run(root / "merged", *lora, "--merge-lora") == 0
    return SimpleNamespace(
        full=root / "full", adapter=root / "adapter", merged=root / "merged", logits=predictions.logits
    )


def tensor_names(path: Path) -> list[str]:
    with safe_open(str(path), "pt") as file:
        return list(file.keys())


@pytest.mark.slow
def test_fine_tuning_every_weight_learns_and_writes_a_transformers_folder_with_a_report(runs, data):
    summary, out = read_summary(runs.full), runs.full
    assert summary["eval_accuracy"] > 0.8 and summary["eval_macro_f1"] > 0.8, summary["eval_accuracy"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["BertForSequenceClassification"]
    assert config["id2label"] == {"0": "neg", "1": "pos"} and config["label2id"] == {"neg": 0, "pos": 1}
    assert not [
        name
        for name in tensor_names(out / "model.safetensors")
        if name.startswith(("module.", "base_model.", "_orig_mod."))
    ]
    card = (out / "README.md").read_text()
    assert (
        "from transformers import AutoModelForSequenceClassification" in card
        and "pipeline_tag: text-classification" in card
    )
    report = json.loads((out / "classification_report.json").read_text())
    confusion = report["confusion_matrix"]
    assert report["labels"] == ["neg", "pos"] and sum(map(sum, confusion)) == 48
    assert report["accuracy"] == pytest.approx(summary["eval_accuracy"]) and report["step"] == summary["steps"] == 60
    assert report["per_class"]["pos"]["support"] == sum(confusion[1]) and set(summary["per_class_f1"]) == {"neg", "pos"}
    assert (out / "confusion_matrix.png").read_bytes().startswith(b"\x89PNG")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    too_long = sum(len(tokenizer(text)["input_ids"]) > 48 for text in data.eval_texts)
    assert summary["truncated_examples"]["eval"] == too_long > 0, "counted as the tokenizer cuts them"
    assert 0 < summary["padded_token_fraction"] < 1 and summary["trainable_parameters"] == summary["parameters"]
    assert summary["tokens_per_second"] > 0


@pytest.mark.slow
def test_a_lora_run_folder_is_a_peft_adapter_folder_with_its_fresh_modules(runs):
    out, summary = runs.adapter, read_summary(runs.adapter)
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {
        path.name for path in out.iterdir()
    }
    assert not (out / "model.safetensors").exists() and not (out / "config.json").exists()
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert (
        adapter["base_model_name_or_path"] == str(runs.full.parent.parent / "bert")
        and adapter["task_type"] == "SEQ_CLS"
    )
    names = tensor_names(out / "adapter_model.safetensors")
    assert any("lora_A" in name for name in names)
    # the pooler the masked-LM checkpoint did not hold was trained in full and is saved: it would reload random
    # otherwise
    assert "base_model.model.bert.pooler.dense.weight" in names and "base_model.model.classifier.weight" in names
    assert 0 < summary["trainable_parameters"] < summary["parameters"] and summary["weights"].endswith(
        "adapter_model.safetensors"
    )
    card = (out / "README.md").read_text()
    assert "from peft import AutoPeftModelForSequenceClassification" in card and "library_name: peft" in card
    assert "id2label={0: 'neg', 1: 'pos'}, label2id={'neg': 0, 'pos': 1}" in card


def test_merge_lora_writes_the_plain_merged_model(runs):
    out = runs.merged
    assert (out / "config.json").exists() and not (out / "adapter_config.json").exists()
    names = tensor_names(out / "model.safetensors")
    assert "bert.pooler.dense.weight" in names and not [
        name for name in names if "lora" in name or name.startswith("base_model")
    ]
    assert "from transformers import AutoModelForSequenceClassification" in (out / "README.md").read_text()
    torch.testing.assert_close(
        runs.logits["merged"], runs.logits["adapter"], rtol=1e-4, atol=1e-5
    )  # same training, merged


LOAD_AS_THE_CARD_SAYS = """
import json, sys, torch
from transformers import AutoTokenizer
texts = json.loads(sys.argv[1])
for folder in sys.argv[2:]:
    namespace = {}
    exec(open(folder + "/README.md").read().split("```python\\n")[1].split("```")[0], namespace)  # the card's own call
    model = namespace["model"].eval()
    batch = AutoTokenizer.from_pretrained(folder)(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        torch.save(model(**batch).logits, folder + "/reloaded_logits.pt")
    print(type(model).__name__, model.config.id2label)
"""


@pytest.mark.slow
def test_each_run_folder_loads_in_a_fresh_process_as_its_card_says_and_predicts_as_trained(runs, data):
    folders = [runs.full, runs.adapter, runs.merged]
    result = subprocess.run(
        [sys.executable, "-c", LOAD_AS_THE_CARD_SAYS, json.dumps(data.eval_texts), *map(str, folders)],
        env=subprocess_env(HF_HUB_OFFLINE="1"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:3] == [
        "BertForSequenceClassification {0: 'neg', 1: 'pos'}",
        "PeftModelForSequenceClassification {0: 'neg', 1: 'pos'}",
        "BertForSequenceClassification {0: 'neg', 1: 'pos'}",
    ]
    labels = torch.tensor([row == "pos" for row in read_column(data.eval, "label")]).long()
    for folder in folders:
        reloaded = torch.load(folder / "reloaded_logits.pt")
        torch.testing.assert_close(reloaded, runs.logits[folder.name], rtol=1e-4, atol=1e-5, msg=folder.name)
        accuracy = (reloaded.argmax(-1) == labels).float().mean().item()
        assert accuracy == pytest.approx(read_summary(folder)["eval_accuracy"]), folder.name


def read_column(path: Path, column: str) -> list:
    import csv

    with path.open() as file:
        return [row[column] for row in csv.DictReader(file)]


def test_group_by_length_pads_less_and_resumes_byte_identically(tmp_path, data, runs):
    args = [*TINY, *source(data), "--max-steps", "8", "--eval-every", "4", "--group-by-length", "--lora-r", "4"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert run(full, *args) == 0
    assert run(part, *args, "--stop-after-steps", "5") == EXIT_PREEMPTED
    assert run(part, *args, "--resume", "auto") == 0
    assert (part / "adapter_model.safetensors").read_bytes() == (full / "adapter_model.safetensors").read_bytes()
    grouped, ungrouped = read_summary(full)["padded_token_fraction"], read_summary(runs.full)["padded_token_fraction"]
    assert grouped < ungrouped / 3, (grouped, ungrouped)


def test_length_grouped_epochs_train_each_example_once_in_batches_of_similar_length():
    from acceltrain.data.loaders import EpochSampler
    from acceltrain.text import LengthGrouped

    lengths = [int(length) for length in torch.randint(3, 200, (1000,), generator=torch.Generator().manual_seed(0))]
    grouped = LengthGrouped(list(range(1000)), lengths, batch_size=10, seed=7)
    order = EpochSampler(1000, seed=7).order(3)
    read = [grouped.sample(index, 3) for index in order]  # as the loop reads epoch 3
    assert sorted(read) == list(range(1000)) and read == grouped.order(3) != grouped.order(4)
    spread = [
        max(lengths[i] for i in read[start : start + 10]) - min(lengths[i] for i in read[start : start + 10])
        for start in range(0, 1000, 10)
    ]
    assert sum(spread) / len(spread) < 10, "batches of similar lengths (random batches: ~160 apart)"


def test_without_max_length_examples_are_cut_at_the_model_s_positions(tmp_path, data, capsys):
    """Round 5 (issue 38, item 8): --max-length is checked against the model's positions (a RuntimeError at step 1 with
    an example longer); left unset it is the default, 256, cut to them (128 here), as causal_lm's --block-size."""
    long_rows = write_rows(tmp_path / "long.csv", [{**row, "text": row["text"] * 8} for row in reviews(48)])
    out = tmp_path / "run"
    given = [arg for arg in TINY if arg not in ("--max-length", "48")]
    given += ["--model-name-or-path", str(data.bert), "--train-file", str(long_rows), "--max-steps", "1"]
    assert run(out, *given) == 0
    assert read_summary(out)["config"]["max_length"] == 128 and read_summary(out)["truncated_examples"]["train"] > 0
    logged = f"--max-length 128: the positions of --model-name-or-path {str(data.bert)!r} (the default, 256, is longer)"
    assert logged in capsys.readouterr().out


@pytest.mark.slow
def test_an_adapter_folder_as_the_model_trains_its_adapter_on(tmp_path, data, capsys):
    """Round 5 (issue 38, item 11): a LoRA adapter folder as --model-name-or-path (Transformers loaded it onto its base,
    frozen) was an AttributeError in check_vocabulary with the adapter on the embeddings. Its adapter trains on now,
    from its own weights, with its own settings; LoRA flags beside it are one line."""
    from safetensors.torch import load_file

    adapter, continued = tmp_path / "adapter", tmp_path / "continued"
    data_args = ["--train-file", str(data.train), "--eval-file", str(data.eval), "--max-steps", "2"]
    assert (
        run(
            adapter,
            *TINY,
            "--model-name-or-path",
            str(data.bert),
            *data_args,
            "--lora-r",
            "4",
            "--lora-target-modules",
            "word_embeddings,query",
        )
        == 0
    )
    assert run(continued, *TINY, "--model-name-or-path", str(adapter), *data_args, "--lr", "1e-12") == 0
    before = load_file(str(adapter / "adapter_model.safetensors"))
    after = load_file(str(continued / "adapter_model.safetensors"))
    assert before.keys() == after.keys() and any("embeddings" in name for name in after)
    for name, tensor in after.items():  # a learning rate of 1e-12: the adapter as given, not a fresh one (lora_B = 0)
        torch.testing.assert_close(tensor, before[name], msg=name)
    assert any("lora_B" in name and tensor.abs().sum() > 0 for name, tensor in after.items())
    summary = read_summary(continued)
    assert 0 < summary["trainable_parameters"] == read_summary(adapter)["trainable_parameters"] < summary["parameters"]
    assert f"continues training the LoRA adapter of --model-name-or-path {str(adapter)!r}" in capsys.readouterr().out
    assert run(tmp_path / "twice", *TINY, "--model-name-or-path", str(adapter), *data_args, "--lora-r", "4") == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: --lora-r adds a LoRA adapter to a model that has one (--model-name-or-path a PEFT adapter "
        "folder: its adapter trains on, with its own settings): drop --lora-r"
    ), err
    assert not (tmp_path / "twice").exists()
    three = write_rows(tmp_path / "three.csv", reviews(48, labels=("neg", "pos", "meh")))
    args = ["--model-name-or-path", str(adapter), "--train-file", str(three), "--max-steps", "2"]
    assert run(tmp_path / "three", *TINY, *args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        f"error: --model-name-or-path {str(adapter)!r}: its LoRA adapter does not load onto its base model ("
    )
    assert "size mismatch" in err and "\n" not in err and not (tmp_path / "three").exists()
    headless = adapter_without_its_head(tmp_path / "headless", data.bert)
    assert run(tmp_path / "random", *TINY, "--model-name-or-path", str(headless), *data_args) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: --model-name-or-path {str(headless)!r}: its LoRA adapter does not carry "
        "bert.pooler.dense.bias, bert.pooler.dense.weight, classifier.bias ..., which its base model lacks "
        "too: they would train frozen at random values (an adapter saved without its new head?)"
    ), err
    assert not (tmp_path / "random").exists()


def adapter_without_its_head(folder: Path, bert: Path) -> Path:
    """An adapter made without a task type: peft then saves neither the new head nor the new pooler."""
    import shutil

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(bert)
    get_peft_model(model, LoraConfig(r=2, target_modules=["query"])).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bert / name, folder / name)
    return folder


def test_pairs_of_texts_and_integer_labels_train(tmp_path, data):
    rows = [
        {"premise": row["text"], "hypothesis": row["text"][::-1], "label": int(row["label"] == "pos")}
        for row in reviews(64)
    ]
    train = write_rows(tmp_path / "pairs.jsonl", rows)
    out = tmp_path / "run"
    assert (
        run(
            out,
            *TINY,
            "--model-name-or-path",
            str(data.bert),
            "--train-file",
            str(train),
            "--text-column",
            "premise",
            "--text-pair-column",
            "hypothesis",
            "--max-steps",
            "2",
            "--eval-fraction",
            "0.25",
        )
        == 0
    )
    assert json.loads((out / "config.json").read_text())["id2label"] == {"0": "0", "1": "1"}
    assert sum(map(sum, json.loads((out / "classification_report.json").read_text())["confusion_matrix"])) == 16


SECTIONS = (1, 2, 3, 5, 7, 8)  # Debian's manual sections: integers, and not the class ids 0..5
IN_A_FRESH_PROCESS = """
import sys
from transformers import AutoModelForSequenceClassification
from acceltrain.commands.cli import main
print(AutoModelForSequenceClassification.from_pretrained(sys.argv[1]).config.id2label)
raise SystemExit(main(["predict", sys.argv[1], sys.argv[2], "--output", sys.argv[3], "--no-progress"]))
"""


def test_integer_labels_that_are_not_the_class_ids_are_class_names(tmp_path, data, capsys):
    """Issue 43 item 11: the manual sections 1, 2, 3, 5, 7, 8 were refused ("the 6 integer labels must be the class
    ids 0..5 (or give class names as strings)"), and a csv cannot give them as strings: datasets reads digits as
    int64. As transformers' run_glue.py: integers that are not exactly 0..K-1 are class names, sorted numerically.
    The eval rows' labels take the training rows' classes; config.json names them for from_pretrained and predict."""
    train = write_rows(tmp_path / "train.csv", reviews(48, labels=SECTIONS))
    evaluated = write_rows(tmp_path / "eval.csv", reviews(12, seed=1, labels=(8, 2, 5, 2)))
    out = tmp_path / "run"
    given = ["--model-name-or-path", str(data.bert), "--train-file", str(train), "--eval-file", str(evaluated)]
    assert run(out, *TINY, *given, "--max-steps", "2") == 0
    assert "labels 1, 2, 3, 5, 7, 8 are not the class ids 0..5: read as 6 class names" in capsys.readouterr().out
    names = [str(section) for section in SECTIONS]
    config = json.loads((out / "config.json").read_text())
    assert config["id2label"] == {str(index): name for index, name in enumerate(names)}
    assert config["label2id"] == {name: index for index, name in enumerate(names)}
    report = json.loads((out / "classification_report.json").read_text())["per_class"]
    assert {name: figures["support"] for name, figures in report.items()} == {
        "1": 0,
        "2": 6,
        "3": 0,
        "5": 3,
        "7": 0,
        "8": 3,
    }, "each eval row in its training class"
    predictions = tmp_path / "predictions.csv"
    result = subprocess.run(
        [sys.executable, "-c", IN_A_FRESH_PROCESS, str(out), str(evaluated), str(predictions)],
        env=subprocess_env(HF_HUB_OFFLINE="1"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[0] == str(dict(enumerate(names)))
    header, *rows = predictions.read_text().splitlines()
    assert header.split(",")[-7:] == ["predicted_label", *(f"probability_{name}" for name in names)]
    assert len(rows) == 12 and {row.split(",")[-7] for row in rows} <= set(names)


def test_metrics_come_from_the_summed_confusion_matrix():
    from acceltrain.text import TextClassificationTask, per_class

    task = TextClassificationTask(["a", "b", "c"])
    # true a: 3 right, 1 as b; true b: 2 right; true c: 1 as a, never right
    sums = {"loss": 2.0, **{f"confusion_{i}": float(n) for i, n in enumerate([3, 1, 0, 0, 2, 0, 1, 0, 0])}}
    metrics = task.eval_metrics(sums, 7)
    assert metrics["accuracy"] == 5 / 7 and metrics["loss"] == 2 / 7
    f1 = {"a": 2 * 0.75 * 0.75 / 1.5, "b": 2 * (2 / 3) * 1 / (2 / 3 + 1), "c": 0.0}
    assert metrics["macro_f1"] == pytest.approx(sum(f1.values()) / 3)
    report = per_class(task.confusion, task.labels)
    assert {label: figures["f1"] for label, figures in report["per_class"].items()} == pytest.approx(f1)
    assert report["per_class"]["c"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 1}
    logits = torch.tensor([[2.0, 0, 0], [0, 2.0, 0]])
    model = lambda **batch: SimpleNamespace(logits=logits)  # noqa: E731
    values = task.eval_values(model, {"input_ids": torch.zeros(2, 3), "labels": torch.tensor([0, 2])})
    assert values["confusion_0"].tolist() == [1, 0] and values["confusion_7"].tolist() == [0, 1]  # (a, a) and (c, b)


@pytest.mark.parametrize("preset", ["text_classification_cpu.yaml", "text_classification_gpu.yaml"])
def test_presets_are_valid(preset):
    cfg = parse_config(
        text_classification.TextClassificationConfig,
        ["--config", str(REPO / "recipes" / "configs" / preset), "--model-name-or-path", "m", "--train-file", "t.csv"],
    )
    assert cfg.optimizer == "adamw" and cfg.lr < 0.01


@pytest.mark.slow
def test_help_imports_no_torch():
    code = (
        "import runpy, sys\nsys.argv = ['x', '--help']\n"
        "try:\n    runpy.run_module('acceltrain.recipes.text_classification', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "assert not {'torch', 'transformers', 'peft'} & set(sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=60
    )
    assert (
        result.returncode == 0 and "--lora-target-modules" in result.stdout and "--group-by-length" in result.stdout
    ), result.stderr


# --------------------------------------------------------------------------- bad input


def make_bad_inputs(root: Path, data) -> dict[str, Path]:
    """Files and folders that are wrong in one way each."""
    import shutil

    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file
    from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerFast

    made = {"empty": root / "empty.csv", "header": root / "header.csv", "suffix": root / "rows.txt"}
    made["empty"].write_text("")
    made["header"].write_text("text,label\n")
    made["suffix"].write_text("text,label\n")
    rows = reviews(8)
    made["gap"] = write_rows(
        root / "gap.jsonl", [{**row, "label": index % 2 * 2} for index, row in enumerate(rows)]
    )  # 0 and 2
    made["gap_unseen"] = write_rows(
        root / "gap_unseen.jsonl", [{**row, "label": index % 2} for index, row in enumerate(rows)]
    )
    made["mixed"] = write_rows(
        root / "mixed.jsonl", [{**row, "label": 1 if index else "pos"} for index, row in enumerate(rows)]
    )
    made["unseen"] = write_rows(root / "unseen.csv", [*rows[:3], {"text": "meh", "label": "meh"}])
    made["one"] = write_rows(root / "one.csv", [{**row, "label": "pos"} for row in rows])
    made["no_label"] = write_rows(root / "no_label.csv", [*rows[:3], {"text": "x", "label": ""}])
    made["no_text"] = write_rows(root / "no_text.jsonl", [*rows[:3], {"text": None, "label": "pos"}])
    for name, drop in (("no_weights", "model.safetensors"), ("no_tokenizer", "tokenizer.json")):
        shutil.copytree(data.bert, root / name)
        for path in (root / name).glob(drop.split(".")[0] + "*"):
            path.unlink()
        made[name] = root / name
    made["no_pad"] = root / "no_pad"
    shutil.copytree(data.bert, made["no_pad"])
    PreTrainedTokenizerFast(tokenizer_file=str(data.bert / "tokenizer.json")).save_pretrained(
        made["no_pad"]
    )  # no special tokens
    made["peft_names"] = root / "peft_names"  # the folder: a peft model's state_dict next to the base config
    shutil.copytree(data.bert, made["peft_names"])
    wrapped = get_peft_model(
        AutoModelForSequenceClassification.from_pretrained(data.bert), LoraConfig(r=2, task_type="SEQ_CLS")
    )
    save_file(
        {name: tensor.contiguous() for name, tensor in wrapped.state_dict().items()},
        str(made["peft_names"] / "model.safetensors"),
    )
    return made


BAD_INPUTS = [
    (
        ["--text-column", "txt"],
        "--text-column 'txt' is not a column of --train-file '{train}': its columns are text, label",
    ),
    (["--label-column", "labels"], "--label-column 'labels' is not a column of"),
    (  # integers that are not 0..K-1 are class names (issue 43 item 11): 1 is not one of 0 and 2
        ["--train-file", "{gap}", "--eval-file", "{gap_unseen}"],
        "--eval-file '{gap_unseen}' has label 1, which no training row has (training labels: 0, 2)",
    ),
    (["--train-file", "{mixed}"], "mixes integers and strings (the integer 1 in row 1, the string 'pos' in row 0)"),
    (
        ["--eval-file", "{unseen}"],
        "--eval-file '{unseen}' has label 'meh', which no training row has (training labels: 'neg', 'pos')",
    ),
    (["--train-file", "{one}"], "has a single label, 'pos': a classifier needs at least 2 classes"),
    (["--train-file", "{no_label}"], "row 3 of --train-file '{no_label}' has no label"),
    (["--train-file", "{no_text}", "--eval-fraction", "0.2"], "has no text (None)"),
    (["--train-file", "{empty}"], "--train-file '{empty}' is empty"),
    (["--train-file", "{header}"], "--train-file '{header}' holds no rows"),
    (["--train-file", "{suffix}"], "--train-file '{suffix}': read files are .csv, .json, .jsonl, .parquet"),
    (
        ["--model-name-or-path", "{no_weights}"],
        "could not load a model from the local folder: Error no file named model.safetensors",
    ),
    (
        ["--model-name-or-path", "{no_tokenizer}"],
        "--model-name-or-path '{no_tokenizer}' has no tokenizer (no tokenizer.json or tokenizer_config.json)",
    ),
    (
        ["--model-name-or-path", "{no_pad}"],
        "the tokenizer has neither a pad token nor an end-of-text token to pad batches with",
    ),
    (["--model-name-or-path", "{peft_names}"], "its weights do not fit its config.json ("),
    (
        ["--lora-r", "4", "--lora-target-modules", "query,valeu"],
        "--lora-target-modules 'valeu' is not a module of BertForSequenceClassification: close names: value; its "
        "linear layers to adapt: ",
    ),
    (["--merge-lora"], "--merge-lora needs --lora-r"),
    (["--max-length", "1"], "--max-length 1 is invalid: must be an integer >= 2"),
    # issue 38 item 8: a RuntimeError at the first batch longer than the positions
    (["--max-length", "512"], "--max-length 512 is longer than --model-name-or-path '{bert}' supports (128 positions)"),
    (
        ["--model-name-or-path", "google-bert/bert-base-uncased"],
        "--model-name-or-path 'google-bert/bert-base-uncased': could not load a tokenizer from the Hugging Face Hub "
        "(offline? pass a local folder instead)",
    ),
    (
        ["--dataset-name", "stanfordnlp/imdb", "--train-file", "x.csv"],
        "exactly one of --train-file FILE and --dataset-name NAME",
    ),
    (
        ["--dataset-name", "stanfordnlp/imdb", "--train-file", "none"],
        "--dataset-name 'stanfordnlp/imdb' could not be loaded",
    ),
]


@pytest.fixture(scope="module")
def bad(data) -> dict[str, Path]:
    folder = data.root / "bad"
    folder.mkdir()
    with offline_on_one_thread(data.root / "hf"):
        return make_bad_inputs(folder, data)


@pytest.mark.parametrize("argv,message", BAD_INPUTS, ids=[f"{i}-{m.split()[0]}" for i, (_, m) in enumerate(BAD_INPUTS)])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, data, bad, capsys, argv, message):
    names = {**{key: str(path) for key, path in bad.items()}, "train": str(data.train), "bert": str(data.bert)}
    out = tmp_path / "out"
    given = [*TINY, *source(data), *[arg.format(**names) for arg in argv], "--max-steps", "1"]
    assert run(out, *given) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and message.format(**names) in err, err
    assert not out.exists(), "bad input must not write anything"


def test_a_model_is_required():
    with pytest.raises(ConfigError, match="give the pretrained model to fine-tune with --model-name-or-path"):
        parse_config(text_classification.TextClassificationConfig, ["--train-file", "t.csv"])


def test_a_failed_save_keeps_the_run_its_checkpoints_metrics_and_tokenizer(tmp_path, data, monkeypatch, capsys):
    """Issue 36 item 4: the recipe removed an output folder its launch had made on any ConfigError, and a failed save
    is one (CheckpointError): a full disk at the step-4 save deleted the step-2 checkpoint, metrics.jsonl and the
    tokenizer, right after saying the previous checkpoints were intact."""
    from acceltrain.checkpoint import writers
    from acceltrain.checkpoint.files import complete_checkpoints

    write_part = writers.write_part

    def full_disk(part, folder, process_group=None):
        if folder.name.endswith("step_00000004"):
            raise OSError(28, "No space left on device")
        return write_part(part, folder, process_group)

    monkeypatch.setattr(writers, "write_part", full_disk)
    out = tmp_path / "run"
    assert run(out, *TINY, *source(data), "--max-steps", "6", "--save-every-steps", "2", "--log-every", "1") == 2
    assert "the previous checkpoints are intact" in capsys.readouterr().err
    assert [p.name for p in complete_checkpoints(out)] == ["step_00000002"]
    assert (out / "metrics.jsonl").read_text().count('"step": 2') >= 1 and (out / "tokenizer.json").is_file()
