"""acceltrain predict (issue 39 item 2): a fine-tuning run folder's predictions for the rows of a file, in the input's
order, on 1 and 2 processes: a classifier's labels give exactly the run's own eval accuracy on its eval file (every
weight, a LoRA adapter of new labels, merged), and a labelled file its metrics; a language model's greedy responses are
those of one prompt at a time; bad input is one line, nothing written, and no --output replaces the input, a run
folder's file or (without --overwrite) any file. Offline, one thread."""

from __future__ import annotations

import csv
import errno
import json
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, check, launch, read_summary
from test_causal_lm import offline_on_one_thread

from acceltrain import ConfigError, predict

sys.path.insert(0, str(REPO / "recipes"))
sys.path.insert(0, str(REPO / "tests" / "helpers"))
import causal_lm  # noqa: E402
import text_classification  # noqa: E402
from in_process import run_in_process  # noqa: E402
from pretrained_folders import (  # noqa: E402
    bert_folder,
    causal_lm_folder,
    conversations,
    instructions,
    reviews,
    write_rows,
)
from test_text_classification import TINY  # noqa: E402

LABELS = ("neg", "pos", "meh")  # three: a LoRA head of other labels than the base config's 2
QUIET = ["--num-workers", "0", "--num-proc", "1", "--no-progress", "--report-to", "none", "--no-plots"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("predict")
    with offline_on_one_thread(root / "hf"):
        bert, gpt2 = bert_folder(root / "bert"), causal_lm_folder(root / "gpt2")
        llama = causal_lm_folder(root / "llama", arch="llama", chat_template=True)
    return SimpleNamespace(
        root=root,
        bert=bert,
        gpt2=gpt2,
        llama=llama,
        chat=write_rows(root / "chat.jsonl", conversations(48)),
        chat_eval=write_rows(root / "chat_eval.jsonl", conversations(9, seed=1)),
        train=write_rows(root / "train.csv", reviews(240, seed=0, labels=LABELS)),
        eval=write_rows(root / "eval.jsonl", reviews(45, seed=1, labels=LABELS, words=(3, 70))),
        sft=write_rows(root / "sft.jsonl", instructions(64)),
        prompts=write_rows(root / "prompts.csv", instructions(13, seed=1)),
        train2=write_rows(root / "train2.csv", reviews(160, seed=2)),
        eval2=write_rows(root / "eval2.jsonl", reviews(30, seed=3)),
    )


@pytest.fixture(autouse=True)
def offline(data):
    with offline_on_one_thread(data.root / "hf"):
        yield


@pytest.fixture(scope="module")
def runs(data) -> SimpleNamespace:
    """A classifier trained in full, as a LoRA adapter and merged, and a LoRA adapter of 2 classes (as many as the
    base config's labels); a causal LM fine-tuned on prompts in full and as an adapter, and one on conversations."""
    root = data.root / "runs"
    source = ["--model-name-or-path", str(data.bert), "--train-file", str(data.train), "--eval-file", str(data.eval)]
    sft = [
        *QUIET,
        "--model-name-or-path",
        str(data.gpt2),
        "--train-file",
        str(data.sft),
        "--block-size",
        "64",
        "--lr",
        "1e-2",
        "--batch-size",
        "8",
        "--max-steps",
        "80",
    ]
    with offline_on_one_thread(data.root / "hf"):
        assert (
            run_in_process(
                text_classification.main,
                text_classification.TextClassificationConfig,
                root / "full",
                *TINY,
                *source,
                "--max-steps",
                "150",
            )
            == 0
        )
        lora = [*TINY, *source, "--max-steps", "150", "--lora-r", "4", "--lr", "3e-2"]
        assert (
            run_in_process(
                text_classification.main, text_classification.TextClassificationConfig, root / "adapter", *lora
            )
            == 0
        )
        assert (
            run_in_process(
                text_classification.main,
                text_classification.TextClassificationConfig,
                root / "merged",
                *lora,
                "--merge-lora",
            )
            == 0
        )
        two = ["--model-name-or-path", str(data.bert), "--train-file", str(data.train2), "--eval-file", str(data.eval2)]
        assert (
            run_in_process(
                text_classification.main,
                text_classification.TextClassificationConfig,
                root / "adapter2",
                *TINY,
                *two,
                "--max-steps",
                "60",
                "--lora-r",
                "4",
                "--lr",
                "3e-2",
            )
            == 0
        )
        assert run_in_process(causal_lm.main, causal_lm.CausalLMConfig, root / "sft", *sft) == 0
        assert (
            run_in_process(
                causal_lm.main, causal_lm.CausalLMConfig, root / "sft_adapter", *sft, "--lora-r", "8", "--lr", "3e-2"
            )
            == 0
        )
        chat = [*sft, "--model-name-or-path", str(data.llama), "--train-file", str(data.chat)]  # the last flag counts
        assert run_in_process(causal_lm.main, causal_lm.CausalLMConfig, root / "chat", *chat) == 0
    names = ("full", "adapter", "merged", "adapter2", "sft", "sft_adapter", "chat")
    return SimpleNamespace(**{name: root / name for name in names})


def truth(data) -> list[str]:
    return [json.loads(line)["label"] for line in data.eval.read_text().splitlines()]


def accuracy(labels: list[str], data) -> float:
    return sum(a == b for a, b in zip(labels, truth(data), strict=True)) / len(labels)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["full", "adapter", "merged"])
def test_a_classifiers_predictions_give_the_runs_own_eval_accuracy(runs, data, kind, tmp_path):
    """Issue 43 item 13: the eval file holds the run's label column, so the rows carry its text and true label beside
    the predicted one, and the metrics are the run's own last evaluation's, written beside the predictions."""
    folder = getattr(runs, kind)
    predictions = predict(folder, data.eval, output=tmp_path / "predictions.csv", batch_size=7)
    summary = read_summary(folder)
    assert accuracy([row["predicted_label"] for row in predictions], data) == summary["eval_accuracy"] > 0.6
    with (tmp_path / "predictions.csv").open() as file:
        written = list(csv.DictReader(file))
    assert list(written[0]) == [
        "text",
        "label",
        "predicted_label",
        "probability_meh",
        "probability_neg",
        "probability_pos",
    ]  # the input's text and true label, then the run's classes, sorted
    rows = [json.loads(line) for line in data.eval.read_text().splitlines()]
    assert [[row["text"], row["label"]] for row in written] == [[row["text"], row["label"]] for row in rows]
    assert [row["predicted_label"] for row in written] == [row["predicted_label"] for row in predictions]
    for row in predictions:
        assert sum(value for key, value in row.items() if key.startswith("probability_")) == pytest.approx(1.0)
    metrics = predictions.metrics
    assert metrics["accuracy"] == summary["eval_accuracy"] and metrics["macro_f1"] == summary["eval_macro_f1"]
    assert metrics["loss"] == pytest.approx(summary["eval_loss"], rel=1e-4)
    report = json.loads((folder / "classification_report.json").read_text())
    assert metrics["confusion_matrix"] == report["confusion_matrix"] and metrics["per_class"] == report["per_class"]
    assert (metrics["rows"], metrics["labelled_rows"], metrics["label_column"]) == (45, 45, "label")
    assert json.loads((tmp_path / "predictions.metrics.json").read_text()) == metrics


def test_an_unlabelled_file_gets_no_metrics_and_a_partly_labelled_one_those_of_its_labelled_rows(runs, tmp_path):
    """Issue 43 item 13: without the run's label column, predictions and the text alone; rows without a label (None)
    are predicted and left out of the metrics."""
    rows = reviews(12, seed=5, labels=LABELS)
    unlabelled = write_rows(tmp_path / "new.csv", [{"text": row["text"]} for row in rows])
    alone = predict(runs.full, unlabelled, output=tmp_path / "new_predictions.csv")
    assert alone.metrics is None and not (tmp_path / "new_predictions.metrics.json").exists()
    assert list(alone[0]) == ["text", "predicted_label", "probability_meh", "probability_neg", "probability_pos"]
    partly = [{**row, "label": row["label"] if index % 3 else None} for index, row in enumerate(rows)]
    labelled = predict(runs.full, write_rows(tmp_path / "partly.jsonl", partly))
    assert [row["predicted_label"] for row in labelled] == [row["predicted_label"] for row in alone]
    assert [row["label"] for row in labelled] == [row["label"] for row in partly]
    hits = [row["predicted_label"] == row["label"] for row in labelled if row["label"] is not None]
    assert (labelled.metrics["rows"], labelled.metrics["labelled_rows"]) == (12, 8)
    assert labelled.metrics["accuracy"] == sum(hits) / 8


def test_the_command_prints_a_labelled_files_metrics_and_writes_them_beside_the_predictions(
    runs, data, tmp_path, capsys
):
    from acceltrain.commands.cli import main

    assert main(["predict", str(runs.full), str(data.eval), "--output", str(tmp_path / "scored.jsonl")]) == 0
    metrics = json.loads((tmp_path / "scored.metrics.json").read_text())
    out = capsys.readouterr().out
    assert (
        f"accuracy {metrics['accuracy']:.4f}, macro-F1 {metrics['macro_f1']:.4f}, loss {metrics['loss']:.4f} "
        f"(45 labelled rows): {tmp_path / 'scored.metrics.json'}" in out
    ), out


def test_an_adapter_folder_without_its_base_settings_predicts_the_runs_classes(runs, data, tmp_path):
    """Issue 43 item 4: a LoRA folder written before adapter_base_settings.json existed (or a copy that lost it)
    loads onto a base config of as many labels, named LABEL_0 and LABEL_1; its classification_report.json names the
    classes. Without that either, one line."""
    folder = tmp_path / "old_adapter"
    shutil.copytree(runs.adapter2, folder)
    (folder / "adapter_base_settings.json").unlink()
    predictions = predict(folder, data.eval2)
    assert list(predictions[0]) == ["text", "label", "predicted_label", "probability_neg", "probability_pos"]
    assert predictions.metrics["accuracy"] == read_summary(runs.adapter2)["eval_accuracy"] > 0.6
    assert predictions == predict(runs.adapter2, data.eval2)
    from acceltrain import load_model

    assert load_model(folder).config.id2label == {0: "neg", 1: "pos"}, "every caller of load_model gets the names"
    (folder / "classification_report.json").unlink()
    with pytest.raises(ConfigError, match="has no adapter_base_settings.json and no readable classification_report"):
        predict(folder, data.eval2)


@pytest.mark.slow
def test_two_processes_predict_each_row_once_in_the_inputs_order(runs, data, tmp_path):
    """45 rows in batches of 7: 7 batches, 4 on one process and 3 on the other (uneven ends)."""
    one = predict(runs.adapter, data.eval, batch_size=7)
    out = tmp_path / "two.jsonl"
    result = check(
        launch(
            Path("-m"),
            [
                "acceltrain.commands.cli",
                "predict",
                str(runs.adapter),
                str(data.eval),
                "--output",
                str(out),
                "--batch-size",
                "7",
                "--progress",
            ],
            processes=2,
            launcher="accelerate",
            HF_HUB_OFFLINE="1",
            HF_HOME=str(data.root / "hf" / "home"),
        )
    )
    two = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["predicted_label"] for row in two] == [row["predicted_label"] for row in one]
    assert accuracy([row["predicted_label"] for row in two], data) == read_summary(runs.adapter)["eval_accuracy"]
    for mine, theirs in zip(one, two, strict=True):  # other batches on each process: the same up to rounding
        assert {k: v for k, v in theirs.items() if k.startswith("probability_")} == pytest.approx(
            {k: v for k, v in mine.items() if k.startswith("probability_")}, rel=1e-4
        )
    assert json.loads((tmp_path / "two.metrics.json").read_text())["accuracy"] == one.metrics["accuracy"]
    assert result.stdout.count("wrote 45 predictions") == 1 and "predict" in result.stderr, (
        "one line, and a progress bar"
    )
    assert "4/4" in result.stderr and "7/7" not in result.stderr, "the main process's bar: its 4 of the 7 batches"


def greedy_one_at_a_time(folder: Path, prompts: list, max_new_tokens: int) -> list[str]:
    """The reference: each prompt alone, no padding, through the model the run folder loads as; a conversation
    (a list of messages) rendered by the chat template, without its last (assistant) message."""
    from transformers import AutoTokenizer

    from acceltrain import load_model

    model, tokenizer = load_model(folder), AutoTokenizer.from_pretrained(folder)
    responses = []
    for prompt in prompts:
        if isinstance(prompt, list):
            text = tokenizer.apply_chat_template(prompt[:-1], tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        else:
            ids = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(
                **ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id
            )
        responses.append(tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True))
    return responses


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sft", "sft_adapter"])
def test_a_language_model_responds_to_each_prompt_as_it_would_alone(runs, data, kind, tmp_path):
    folder = getattr(runs, kind)
    prompts = [row["prompt"] for row in instructions(13, seed=1)]
    predictions = predict(folder, data.prompts, output=tmp_path / "responses.parquet", batch_size=4, max_new_tokens=6)
    responses = [row["response"] for row in predictions]
    assert responses == greedy_one_at_a_time(folder, prompts, 6)
    import pyarrow.parquet as pq

    assert pq.read_table(tmp_path / "responses.parquet").column("response").to_pylist() == responses
    if kind == "sft":  # LoRA on this tiny random base learns little in 80 steps
        assert sum(bool(response) for response in responses) >= 10, responses  # not the end-of-text token at once


def test_a_conversation_is_answered_through_the_chat_template(runs, data):
    rows = conversations(9, seed=1)
    responses = [row["response"] for row in predict(runs.chat, data.chat_eval, batch_size=4, max_new_tokens=5)]
    assert responses == greedy_one_at_a_time(runs.chat, [row["messages"] for row in rows], 5)


def another_task_folder(runs, root: Path) -> Path:
    """The full classifier's folder with a masked-LM head's config: a run folder of a task predict does not read."""
    folder = root / "masked_lm"
    shutil.copytree(runs.full, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["BertForMaskedLM"]}))
    return folder


def folder_named(path: Path) -> Path:
    path.mkdir()
    return path


def unwritable_folder(root: Path) -> Path:
    """A folder this process cannot create a file in: a read-only one, or, for root (whom file modes do not stop),
    /sys."""
    if os.geteuid() == 0:
        return Path("/sys")
    folder = folder_named(root / "read_only")
    folder.chmod(0o555)
    return folder


def strict_chat_folder(runs, root: Path) -> Path:
    """The chat run folder with a chat template that refuses roles other than user and assistant, as many do."""
    folder = root / "strict_chat"
    shutil.copytree(runs.chat, folder)
    strict = "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('Conversation "
    (folder / "chat_template.jinja").write_text(strict + "roles must be user or assistant') }}{% endif %}{% endfor %}")
    return folder


BAD = [
    (
        lambda runs, data, root: [root, data.eval],
        "RUN_FOLDER '{root}' is not the folder of a finished run (no train_config.yaml beside a config.json or "
        "adapter_config.json)",
    ),
    (lambda runs, data, root: [root / "none", data.eval], "RUN_FOLDER '{root}/none' is not a folder"),
    (
        lambda runs, data, root: [another_task_folder(runs, root), data.eval],
        "RUN_FOLDER '{root}/masked_lm' holds a model that loads with AutoModelForMaskedLM: predict reads the run "
        "folders of text "
        "classification (recipes/text_classification.py) or language models (recipes/causal_lm.py)",
    ),
    (
        lambda runs, data, root: [runs.sft, data.eval],
        "--text-column 'prompt' is not a column of FILE '{eval}': its columns are text, label ('{sft}' is a "
        "text-generation run folder: "
        "it reads prompts to respond to; --text-column names the column)",
    ),
    (
        lambda runs, data, root: [runs.full, data.prompts],
        "--text-column 'text' is not a column of FILE '{prompts}': its columns are prompt, response ('{full}' is a "
        "text-classification",
    ),
    (
        lambda runs, data, root: [
            runs.full,
            write_rows(root / "gap.jsonl", [{"text": "good", "label": "pos"}, {"text": None, "label": "neg"}]),
        ],
        "--text-column 'text': row 1 of FILE '{root}/gap.jsonl' has no text (None)",
    ),
    (
        lambda runs, data, root: [runs.full, root / "rows.txt"],
        "FILE '{root}/rows.txt': read files are .csv, .json, .jsonl, .parquet",
    ),
    (
        lambda runs, data, root: [runs.full, data.eval, "--output", "out.txt"],
        "--output 'out.txt' is invalid: must be a file named .csv, .json, .jsonl, .parquet",
    ),
    (
        lambda runs, data, root: [runs.full, data.eval, "--output", "nowhere/out.csv"],
        "--output 'nowhere/out.csv': there is no folder 'nowhere' to write it in",
    ),
    (  # issue 43 item 7
        lambda runs, data, root: [runs.full, data.eval, "--output", folder_named(root / "out.csv"), "--overwrite"],
        "--output '{root}/out.csv' is a directory, not a file: give the name of a file to write",
    ),
    (
        lambda runs, data, root: [runs.full, data.eval, "--output", unwritable_folder(root) / "out.csv"],
        "/out.csv' cannot be written: ",
    ),
    (  # issue 43 item 8
        lambda runs, data, root: [
            runs.chat,
            write_rows(
                root / "lone.jsonl", [conversations(1)[0], {"messages": [{"role": "assistant", "content": "good"}]}]
            ),
        ],
        "row 1 of FILE '{root}/lone.jsonl': the conversation has no message to respond to (a final assistant "
        "message is the reference answer, left out): give it a user message",
    ),
    (  # issue 43 item 13
        lambda runs, data, root: [
            runs.full,
            write_rows(root / "new_label.jsonl", [{"text": "good", "label": "pos"}, {"text": "bad", "label": "awful"}]),
        ],
        "the run's label column 'label': row 1 of FILE '{root}/new_label.jsonl' has label 'awful', which is not one "
        "of the run's classes ('meh', 'neg', 'pos'): correct it, or rename the column to predict without metrics",
    ),
    (
        lambda runs, data, root: [
            strict_chat_folder(runs, root),
            write_rows(root / "tool.jsonl", [{"messages": [{"role": "tool", "content": "good"}]}]),
        ],
        "row 0 of FILE '{root}/tool.jsonl': the tokenizer's chat template refuses the conversation: Conversation roles "
        "must be user or assistant",
    ),
    (
        lambda runs, data, root: [
            runs.full,
            write_rows(root / "clash.jsonl", [{"probability_neg": "good film"}]),
            "--text-column",
            "probability_neg",
        ],
        "the column 'probability_neg' of FILE '{root}/clash.jsonl', which predict carries into its output, has the "
        "name of a column it writes: rename it",
    ),
    (
        lambda runs, data, root: [runs.sft, data.prompts, "--max-new-tokens", "256"],
        "--max-new-tokens 256 leaves no room for a prompt: the model reads 256 tokens",
    ),
    (
        lambda runs, data, root: [runs.full, data.eval, "--batch-size", "0"],
        "--batch-size 0 is invalid: must be an integer >= 1",
    ),
]


@pytest.mark.parametrize(
    "make,message", BAD, ids=[f"{index}-{message.split()[0]}" for index, (_, message) in enumerate(BAD)]
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(runs, data, tmp_path, capsys, make, message):
    from acceltrain.commands.cli import main

    argv = [str(arg) for arg in make(runs, data, tmp_path)]
    before = sorted(tmp_path.rglob("*"))
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        assert main(["predict", *argv]) == 2
    err = capsys.readouterr().err.strip()
    names = {"root": tmp_path, "eval": data.eval, "prompts": data.prompts, "sft": runs.sft, "full": runs.full}
    assert err.startswith("error: ") and "\n" not in err and message.format(**names) in err, err
    assert sorted(tmp_path.rglob("*")) == before, "nothing written, no .partial file left"


def files_of(*folders: Path) -> dict[Path, bytes]:
    return {path: path.read_bytes() for folder in folders for path in sorted(folder.rglob("*")) if path.is_file()}


def linked(link: Path, target: Path, *, hard: bool = False) -> Path:
    if hard:
        os.link(target, link)
    else:
        link.symlink_to(target)
    return link


OWN = {  # issue 43 item 2: an --output that names a file predict does not own, in the copies the test makes
    "the input": lambda root: root / "eval_in.csv",
    "a symlink to the input": lambda root: linked(root / "link.csv", root / "eval_in.csv"),
    "a hard link to the input": lambda root: linked(root / "hard.csv", root / "eval_in.csv", hard=True),
    "config.json": lambda root: root / "full" / "config.json",
    "summary.json": lambda root: root / "full" / "summary.json",
    "tokenizer_config.json": lambda root: root / "full" / "tokenizer_config.json",
    "adapter_config.json": lambda root: root / "adapter" / "adapter_config.json",
    "a new file in the run folder": lambda root: root / "full" / "predictions.csv",
    "a run folder's file through a symlinked folder": lambda root: linked(root / "via", root / "full") / "summary.json",
}


@pytest.mark.parametrize("target", OWN)
def test_the_output_is_never_the_input_or_a_run_folders_file_even_with_overwrite(runs, data, tmp_path, capsys, target):
    """Before the fix each of these was replaced with exit 0: the input lost, the run folder no longer loading."""
    from acceltrain.commands.cli import main

    for name in ("full", "adapter"):
        shutil.copytree(getattr(runs, name), tmp_path / name)
    write_rows(tmp_path / "eval_in.csv", [json.loads(line) for line in data.eval.read_text().splitlines()])
    output = OWN[target](tmp_path)
    folder = tmp_path / ("adapter" if target == "adapter_config.json" else "full")
    before = files_of(tmp_path)
    argv = ["predict", str(folder), str(tmp_path / "eval_in.csv"), "--output", str(output), "--overwrite"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    refused = "is FILE" if "input" in target else "is inside RUN_FOLDER"
    assert err.startswith(f"error: --output {str(output)!r} {refused}") and "\n" not in err, err
    assert files_of(tmp_path) == before
    assert not (folder / "predictions.csv").exists()


def test_an_existing_output_or_metrics_file_is_replaced_only_with_overwrite(runs, data, tmp_path, capsys):
    """As acceltrain merge refuses an OUT that is not empty: a typo must not replace last week's predictions."""
    from acceltrain.commands.cli import main

    out, metrics = tmp_path / "scored.csv", tmp_path / "scored.metrics.json"
    argv = ["predict", str(runs.full), str(data.eval), "--output", str(out)]
    for existing, subject in ((out, ""), (metrics, f": its metrics file {str(metrics)!r}")):
        existing.write_text("mine\n")
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"error: --output {str(out)!r}{subject} exists: pass --overwrite to replace it", err
        with pytest.raises(ConfigError, match="exists: pass --overwrite"):
            predict(runs.full, data.eval, output=out)
        assert existing.read_text() == "mine\n"
        if existing == out:
            out.unlink()
    assert not out.exists(), "the metrics file is checked before anything is written"
    assert main(["predict", str(runs.full), str(data.eval), "--output", str(out), "--overwrite"]) == 0
    assert len(out.read_text().splitlines()) == 46 and json.loads(metrics.read_text())["labelled_rows"] == 45
    assert predict(runs.full, data.eval, output=out, overwrite=True).metrics is not None
    with pytest.raises(SystemExit):
        main(["predict", "--help"])
    assert "--overwrite" in capsys.readouterr().out


def test_a_failed_write_leaves_nothing_behind_and_is_one_line(runs, data, tmp_path, monkeypatch):
    """Issue 43 item 7: a disk that fills while the predictions are written."""
    import datasets

    def full_disk(self, path, **kwargs):
        Path(path).write_text("half a table")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(datasets.Dataset, "to_csv", full_disk)
    with pytest.raises(ConfigError, match="could not be written: No space left on device"):
        predict(runs.full, data.eval, output=tmp_path / "scored.csv")
    assert list(tmp_path.iterdir()) == []


def test_the_function_refuses_bad_input_with_a_config_error(runs, data):
    with pytest.raises(ConfigError, match="--max-new-tokens 0 is invalid"):
        predict(runs.sft, data.prompts, max_new_tokens=0)
