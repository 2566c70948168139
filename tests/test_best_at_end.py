"""``--load-best-at-end`` (issue 39 item 4): with ``--keep-best``, the run folder's weights are the best evaluation's,
as Trainer's ``load_best_model_at_end``. A metric that peaks at the 2nd of 4 evaluations (step 4 of 8): the folder's
weights equal those of the same run stopped at step 4 (a constant learning rate, so the first 4 steps are the same),
on 1 and 2 processes and for a LoRA adapter; summary.json and the model card say which step they come from."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import REPO, check, launch

from acceltrain import ConfigError, TrainConfig

sys.path.insert(0, str(REPO / "tests" / "helpers"))
from pretrained_folders import bert_folder  # noqa: E402

MATRIX_RECIPE = REPO / "tests" / "helpers" / "matrix_recipe.py"
RUN = [
    "--batch-size",
    "4",
    "--lr",
    "0.05",
    "--lr-schedule",
    "constant",
    "--warmup-steps",
    "0",
    "--eval-every",
    "2",
    "--peaking-metric",
    "--no-progress",
    "--num-workers",
    "0",
    "--report-to",
    "none",
    "--log-every",
    "1",
]
CASES = {
    "one process": ("cnn", {}),
    "two processes": ("cnn", {"processes": 2, "launcher": "accelerate"}),
    "lora": ("lora", {}),
}


def weights(out: Path) -> bytes:
    adapter = out / "adapter_model.safetensors"
    return (adapter if adapter.is_file() else out / "model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return bert_folder(tmp_path_factory.mktemp("best-base") / "bert", with_tokenizer=False)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_the_run_folder_holds_the_best_evaluations_weights(case, base, tmp_path):
    kind, where = CASES[case]
    model = ["--kind", kind, *(["--base", str(base), "--lora-r", "4"] if kind == "lora" else [])]
    best, at_four = tmp_path / "best", tmp_path / "four"
    check(
        launch(
            MATRIX_RECIPE,
            [*RUN, *model, "--max-steps", "8", "--keep-best", "--load-best-at-end", "--output-dir", str(best)],
            **where,
        )
    )
    check(launch(MATRIX_RECIPE, [*RUN, *model, "--max-steps", "4", "--output-dir", str(at_four)], **where))
    summary = json.loads((best / "summary.json").read_text())
    assert (summary["steps"], summary["weights_step"], summary["eval_accuracy"]) == (8, 4, 0.2)
    assert weights(best) == weights(at_four), "the weights of step 4, the best evaluation"
    assert "Its weights are step 4's, the best evaluation" in (best / "README.md").read_text()


def test_load_best_at_end_without_keep_best_or_evaluation_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="--load-best-at-end needs --keep-best"):
        TrainConfig(load_best_at_end=True).validate()
    from acceltrain.hooks import CheckpointSchedule

    with pytest.raises(
        ConfigError, match="--load-best-at-end keeps the best evaluation's weights, and this run has no eval"
    ):
        CheckpointSchedule.from_config(TrainConfig(keep_best=True, load_best_at_end=True), evaluates=False)
