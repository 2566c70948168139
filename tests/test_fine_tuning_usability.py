"""Issue 39 item 5, fine-tuning as people do it: --label-smoothing and --class-weights balanced in the classifier's
loss; no LOAD REPORT table or peft FutureWarning in a run's output (other warnings kept); a LoRA folder of new labels
loads with no argument; the model card's parameter counts agree with summary.json, its settings are resolved (also
after a resume), and its "same run again" command works from anywhere. Offline, one thread."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, read_summary, subprocess_env
from test_causal_lm import offline_on_one_thread

from acceltrain import ConfigError, parse_config
from acceltrain.config.train_config import run_changes
from acceltrain.runtime.preemption import EXIT_PREEMPTED

sys.path.insert(0, str(REPO / "recipes"))
sys.path.insert(0, str(REPO / "tests" / "helpers"))
import text_classification  # noqa: E402
from in_process import run_in_process  # noqa: E402
from pretrained_folders import bert_folder, reviews, write_rows  # noqa: E402
from test_text_classification import TINY  # noqa: E402

LABELS = ("neg", "pos", "meh")
Config = text_classification.TextClassificationConfig


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("usability")
    with offline_on_one_thread(root / "hf"):
        bert = bert_folder(root / "bert")
    write_rows(root / "train.csv", reviews(120, labels=LABELS))
    write_rows(root / "eval.csv", reviews(30, seed=1, labels=LABELS))
    return SimpleNamespace(root=root, bert=bert)


@pytest.fixture(autouse=True)
def offline(data):
    with offline_on_one_thread(data.root / "hf"):
        yield


def recipe(data, *args: str) -> subprocess.CompletedProcess:
    """The recipe as a user runs it, from the data's folder with relative paths."""
    command = [
        sys.executable,
        str(REPO / "recipes" / "text_classification.py"),
        *TINY,
        "--model-name-or-path",
        "bert",
        "--train-file",
        "train.csv",
        "--eval-file",
        "eval.csv",
        *args,
    ]
    return subprocess.run(
        command,
        cwd=data.root,
        env=subprocess_env(HF_HUB_OFFLINE="1", HF_HOME=str(data.root / "hf" / "home")),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def adapter(data):
    """A LoRA run of 3 labels, stopped at step 2 and resumed to step 4; the first launch's output."""
    args = ["--lora-r", "4", "--max-steps", "4", "--output-dir", "adapter"]
    first = recipe(data, *args, "--stop-after-steps", "2")
    assert first.returncode == EXIT_PREEMPTED, first.stderr[-3000:]
    resumed = recipe(data, *args, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return SimpleNamespace(folder=data.root / "adapter", output=first.stdout + first.stderr)


# --------------------------------------------------------------------------- the classifier's loss


def test_label_smoothing_and_balanced_class_weights_shape_the_training_loss_alone():
    from acceltrain.text import TextClassificationTask, balanced_class_weights

    weights = balanced_class_weights([0, 0, 0, 1, 2, 2], ["a", "b", "c"])
    assert weights == pytest.approx([6 / 9, 6 / 3, 6 / 6])  # samples / (classes x count): scikit-learn's "balanced"
    with pytest.raises(ConfigError, match="^--class-weights balanced: class 'c' has no training example to weigh$"):
        balanced_class_weights([0, 1, 1], ["a", "b", "c"])
    logits, labels = torch.randn(6, 3, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 0, 0, 1, 2, 2])
    model = lambda **batch: SimpleNamespace(logits=logits)  # noqa: E731
    batch = {"input_ids": torch.zeros(6, 2), "labels": labels}
    task = TextClassificationTask(["a", "b", "c"], label_smoothing=0.1, class_weights=weights)
    expected = F.cross_entropy(logits, labels, weight=torch.tensor(weights), label_smoothing=0.1)
    torch.testing.assert_close(task.train_loss(model, batch), expected)
    torch.testing.assert_close(
        task.eval_values(model, batch)["loss"], F.cross_entropy(logits, labels, reduction="none")
    )


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--label-smoothing", "1"], "--label-smoothing 1.0 is invalid: must be a number in [0, 1)"),
        (["--class-weights", "inverse"], "--class-weights 'inverse' is invalid: choose one of none, balanced"),
    ],
)
def test_bad_loss_settings_are_one_line(argv, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        parse_config(Config, ["--model-name-or-path", "m", "--train-file", "t.csv", *argv])


def test_the_loss_settings_are_config_so_a_resume_compares_them():
    base = ["--model-name-or-path", "m", "--train-file", "t.csv"]
    saved = parse_config(Config, base).to_dict()
    changed = parse_config(Config, [*base, "--label-smoothing", "0.1", "--class-weights", "balanced"])
    assert run_changes(saved, changed) == {"label_smoothing": [0.0, 0.1], "class_weights": ["none", "balanced"]}


def test_a_run_with_balanced_class_weights_records_them(data, tmp_path):
    rows = reviews(90, labels=LABELS)[:70]  # 24 neg, 23 pos, 23 meh
    train = write_rows(tmp_path / "uneven.csv", rows)
    assert (
        run_in_process(
            text_classification.main,
            Config,
            tmp_path / "run",
            *TINY,
            "--model-name-or-path",
            str(data.bert),
            "--train-file",
            str(train),
            "--eval-fraction",
            "0",
            "--max-steps",
            "2",
            "--class-weights",
            "balanced",
            "--label-smoothing",
            "0.1",
        )
        == 0
    )
    counts = {label: sum(row["label"] == label for row in rows) for label in LABELS}
    assert read_summary(tmp_path / "run")["class_weights"] == pytest.approx(
        {label: 70 / (3 * n) for label, n in counts.items()}
    )


# --------------------------------------------------------------------------- what a run prints


@pytest.mark.slow
def test_a_run_prints_no_load_report_nor_peft_deprecation_but_says_what_starts_afresh(adapter):
    assert "LOAD REPORT" not in adapter.output and "is_gradient_checkpointing" not in adapter.output, adapter.output[
        :3000
    ]
    assert (
        "4 tensors the checkpoint lacks (bert.pooler.dense.bias, bert.pooler.dense.weight, classifier.bias and 1 more) "
        "start "
        "from random values (a new head)" in adapter.output
    )


class Recorded(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_quiet_loading_keeps_every_other_warning():
    from acceltrain.runtime.logs import quiet_model_loading

    modeling, recorded = logging.getLogger("transformers.modeling_utils"), Recorded()
    modeling.addHandler(recorded)
    level, modeling.level = modeling.level, logging.WARNING  # whatever --log-level set on transformers' logger
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with quiet_model_loading():
                modeling.warning("BertModel LOAD REPORT from: x\n| key | MISSING |")
                modeling.warning("a real warning")
                warnings.warn(
                    "`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning, stacklevel=1
                )
                warnings.warn("another deprecation", FutureWarning, stacklevel=1)
    finally:
        modeling.removeHandler(recorded)
        modeling.setLevel(level)
    assert recorded.messages == ["a real warning"]
    assert [str(warning.message) for warning in caught] == ["another deprecation"]


# --------------------------------------------------------------------------- the run folder and its card


@pytest.mark.slow
def test_a_lora_folder_of_new_labels_loads_with_no_argument(adapter):
    settings = json.loads((adapter.folder / "adapter_base_settings.json").read_text())
    assert settings["id2label"] == {"0": "meh", "1": "neg", "2": "pos"}
    code = (
        "import sys\nfrom acceltrain import load_model\nmodel = load_model(sys.argv[1])\n"
        "print(type(model).__name__, model.config.id2label)"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code, str(adapter.folder)],
        env=subprocess_env(HF_HUB_OFFLINE="1"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.strip() == "PeftModelForSequenceClassification {0: 'meh', 1: 'neg', 2: 'pos'}"
    card = (adapter.folder / "README.md").read_text()
    assert f'from acceltrain import load_model; model = load_model("{adapter.folder}")' in card


@pytest.mark.slow
def test_the_card_shows_resolved_settings_after_a_resume(adapter):
    card = (adapter.folder / "README.md").read_text()
    assert "| lora_alpha | 8 |" in card and "| lora_r | 4 |" in card, "--lora-alpha unset: 2 x --lora-r"


@pytest.mark.slow
def test_the_cards_same_run_again_command_works_from_inside_the_run_folder(adapter, data):
    again = re.search(
        r"the same run again, from the folder it was started in: `(.+?)`\.", (adapter.folder / "README.md").read_text()
    )[1]
    assert again.startswith(f"cd {data.root} && ") and f"--config {adapter.folder}/train_config.yaml" in again
    again = again.replace(" && python ", f" && {sys.executable} ", 1)  # this environment's python, whatever PATH says
    result = subprocess.run(
        f"{again} --max-steps 1 --output-dir {data.root / 'again'}",
        shell=True,
        cwd=adapter.folder,
        env=subprocess_env(HF_HUB_OFFLINE="1", HF_HOME=str(data.root / "hf" / "home")),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_summary(data.root / "again")["steps"] == 1


def test_a_merged_cards_parameter_counts_agree_with_the_summary(data, tmp_path):
    out = tmp_path / "merged"
    assert (
        run_in_process(
            text_classification.main,
            Config,
            out,
            *TINY,
            "--model-name-or-path",
            str(data.bert),
            "--train-file",
            str(data.root / "train.csv"),
            "--max-steps",
            "2",
            "--lora-r",
            "4",
            "--merge-lora",
        )
        == 0
    )
    summary = read_summary(out)
    from acceltrain import load_model

    held = sum(parameter.numel() for parameter in load_model(out).parameters())
    assert held < summary["parameters"], "the adapter's own weights are merged in"
    assert (
        f"{summary['trainable_parameters']:,} trainable of {summary['parameters']:,} parameters while training, "
        "merged into "
        f"{held:,}"
    ) in (out / "README.md").read_text()
