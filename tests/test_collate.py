"""``fit(collate_fn=...)`` with a function that returns what the task cannot take (issue 38 items 1 and 7): one line
naming the function, before training, and nothing left in the output folder. An ``(inputs, labels)`` pair trains a
text classifier as its tokenizer's mapping does."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, subprocess_env
from torch import nn

from acceltrain import ConfigError, TrainConfig, fit
from acceltrain.text import TextClassificationTask


class Words(torch.utils.data.Dataset):
    """Token ids of 6 words; the label is whether word 3 occurs."""

    def __init__(self, count: int = 32):
        self.ids = torch.randint(1, 8, (count, 6), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": int((self.ids[index] == 3).any())}


class Bag(nn.Module):
    """A bag of embeddings with a Transformers-like output (``.logits``)."""

    def __init__(self):
        super().__init__()
        self.embedding, self.head = nn.Embedding(8, 4), nn.Linear(4, 2)

    def forward(self, input_ids, attention_mask=None):
        return SimpleNamespace(logits=self.head(self.embedding(input_ids).mean(dim=1)))


def config(tmp_path, **extra) -> TrainConfig:
    return TrainConfig(
        output_dir=str(tmp_path / "run"),
        batch_size=8,
        max_steps=2,
        lr=0.1,
        num_workers=0,
        progress=False,
        report_to="none",
        **extra,
    )


def stacked(samples):
    return {
        "input_ids": torch.stack([s["input_ids"] for s in samples]),
        "labels": torch.tensor([s["labels"] for s in samples]),
    }


def as_list(samples):
    return list(samples)


def without_labels(samples):
    return {"input_ids": stacked(samples)["input_ids"]}


def string_labels(samples):
    return {**stacked(samples), "labels": [str(s["labels"]) for s in samples]}


def pair(samples):
    batch = stacked(samples)
    return {"input_ids": batch["input_ids"]}, batch["labels"]


@pytest.mark.parametrize(
    ("collate", "said"),
    [
        (
            as_list,
            "returned a list of 2 items; TextClassificationTask takes a mapping of the model's inputs and 'labels'",
        ),
        (
            without_labels,
            "returned a mapping of input_ids; TextClassificationTask takes a mapping of the model's inputs and "
            "'labels'",
        ),
        (string_labels, "returned labels as a list of 2 items: class labels must be an integer tensor"),
    ],
)
def test_a_batch_the_task_cannot_take_is_one_line_naming_the_collate_function(tmp_path, collate, said):
    model = Bag()
    with pytest.raises(ConfigError) as error:
        fit(
            config(tmp_path),
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            Words(),
            task=TextClassificationTask(["no", "yes"]),
            collate_fn=collate,
        )
    assert str(error.value).startswith(f"the collate function {collate.__name__} ") and said in str(error.value)
    assert "\n" not in str(error.value) and not (tmp_path / "run").exists()


def test_an_inputs_labels_pair_trains_as_the_mapping_does(tmp_path):
    results = []
    for collate in (stacked, pair):
        torch.manual_seed(0)
        model = Bag()
        fit(
            config(tmp_path / collate.__name__),
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            Words(),
            task=TextClassificationTask(["no", "yes"]),
            collate_fn=collate,
        )
        results.append(model.head.weight.detach().clone())
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


NONE_COLLATE = """
import sys, torch
from acceltrain import TrainConfig, fit, run_recipe
from acceltrain.vision import ImageClassification, synthetic_images

def main(cfg):
    (x, y), _ = synthetic_images(32, 8, seed=0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 10))
    def forgot_to_return(samples):
        torch.utils.data.default_collate(samples)
    fit(cfg, model, torch.optim.SGD(model.parameters(), lr=0.1), ImageClassification(x, y, [str(i) for i in range(10)]),
        collate_fn=forgot_to_return)

run_recipe(main, TrainConfig, sys.argv[1:])
"""


@pytest.mark.slow
def test_a_collate_function_that_returns_none_is_one_line_not_an_endless_loop(tmp_path):
    """Before: None was the loop's own end-of-epoch value, so every epoch ended at its first batch and the next began,
    forever, ignoring SIGTERM."""
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            NONE_COLLATE,
            "--output-dir",
            str(tmp_path / "run"),
            "--max-steps",
            "2",
            "--batch-size",
            "8",
            "--num-workers",
            "0",
            "--report-to",
            "none",
            "--no-progress",
        ],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip() == (
        "error: the collate function main.<locals>.forgot_to_return returned None (a missing "
        "return?): it must return a batch ClassificationTask takes"
    )
    assert not (tmp_path / "run").exists()
