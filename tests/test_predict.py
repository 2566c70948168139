"""acceltrain predict (issue 39 item 2): a fine-tuning run folder's predictions for the rows of a file, in the input's
order, on 1 and 2 processes: a classifier's labels give exactly the run's own eval accuracy on its eval file (every
weight, a LoRA adapter of new labels, merged), a language model's greedy responses are those of one prompt at a time;
bad input is one line, nothing written. Offline, one thread."""

from __future__ import annotations

import csv
import json
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
    )


@pytest.fixture(autouse=True)
def offline(data):
    with offline_on_one_thread(data.root / "hf"):
        yield


@pytest.fixture(scope="module")
def runs(data) -> SimpleNamespace:
    """A classifier trained in full, as a LoRA adapter and merged; a causal LM fine-tuned on prompts in full and as an
    adapter, and one on conversations."""
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
        assert run_in_process(causal_lm.main, causal_lm.CausalLMConfig, root / "sft", *sft) == 0
        assert (
            run_in_process(
                causal_lm.main, causal_lm.CausalLMConfig, root / "sft_adapter", *sft, "--lora-r", "8", "--lr", "3e-2"
            )
            == 0
        )
        chat = [*sft, "--model-name-or-path", str(data.llama), "--train-file", str(data.chat)]  # the last flag counts
        assert run_in_process(causal_lm.main, causal_lm.CausalLMConfig, root / "chat", *chat) == 0
    names = ("full", "adapter", "merged", "sft", "sft_adapter", "chat")
    return SimpleNamespace(**{name: root / name for name in names})


def truth(data) -> list[str]:
    return [json.loads(line)["label"] for line in data.eval.read_text().splitlines()]


def accuracy(labels: list[str], data) -> float:
    return sum(a == b for a, b in zip(labels, truth(data), strict=True)) / len(labels)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["full", "adapter", "merged"])
def test_a_classifiers_predictions_give_the_runs_own_eval_accuracy(runs, data, kind, tmp_path):
    folder = getattr(runs, kind)
    predictions = predict(folder, data.eval, output=tmp_path / "predictions.csv", batch_size=7)
    assert accuracy([row["label"] for row in predictions], data) == read_summary(folder)["eval_accuracy"] > 0.6
    with (tmp_path / "predictions.csv").open() as file:
        written = list(csv.DictReader(file))
    assert list(written[0]) == [
        "label",
        "probability_meh",
        "probability_neg",
        "probability_pos",
    ]  # the run's classes, sorted
    assert [row["label"] for row in written] == [row["label"] for row in predictions]
    for row in predictions:
        assert sum(value for key, value in row.items() if key.startswith("probability_")) == pytest.approx(1.0)


@pytest.mark.slow
def test_two_processes_predict_each_row_once_in_the_inputs_order(runs, data, tmp_path):
    """45 rows in batches of 7: 7 batches, 4 on one process and 3 on the other (uneven ends)."""
    one = predict(runs.adapter, data.eval, batch_size=7)
    out = tmp_path / "two.jsonl"
    result = check(
        launch(
            Path("-m"),
            [
                "acceltrain.cli",
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
    assert [row["label"] for row in two] == [row["label"] for row in one]
    assert accuracy([row["label"] for row in two], data) == read_summary(runs.adapter)["eval_accuracy"]
    for mine, theirs in zip(one, two, strict=True):  # other batches on each process: the same up to rounding
        assert {k: v for k, v in theirs.items() if k != "label"} == pytest.approx(
            {k: v for k, v in mine.items() if k != "label"}, rel=1e-4
        )
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
    from acceltrain.cli import main

    argv = [str(arg) for arg in make(runs, data, tmp_path)]
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        assert main(["predict", *argv]) == 2
    err = capsys.readouterr().err.strip()
    names = {"root": tmp_path, "eval": data.eval, "prompts": data.prompts, "sft": runs.sft, "full": runs.full}
    assert err.startswith("error: ") and "\n" not in err and message.format(**names) in err, err
    assert not (tmp_path / "predictions.csv").exists()


def test_the_function_refuses_bad_input_with_a_config_error(runs, data):
    with pytest.raises(ConfigError, match="--max-new-tokens 0 is invalid"):
        predict(runs.sft, data.prompts, max_new_tokens=0)
