"""Evaluation you can see and size (an eval bar, a training ETA that counts evaluations, ``--eval-samples``),
the decode cache of ``--data-on-device`` (a bar, one line saying where, ``ACCELTRAIN_CACHE``), and image
datasets through ``datasets`` (a local folder in the Hub's layout; offline, as ``HF_DATASETS_OFFLINE=1`` runs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, TINY_RECIPE, check, launch, read_events, read_summary, run_tiny_in_process, subprocess_env
from torch.utils.data import TensorDataset

from acceltrain import ConfigError, TrainConfig, fit
from acceltrain.config.parser import parse_config
from acceltrain.config.train_config import run_changes
from acceltrain.data.eval_subset import eval_subset, eval_subset_indices
from acceltrain.hooks import Console, Evaluation
from acceltrain.vision import ImageClassification, image_datasets
from acceltrain.vision.device_loader import decoded_images
from acceltrain.vision.images import decode_image_file

TINY = [
    "--num-train",
    "32",
    "--num-eval",
    "37",
    "--batch-size",
    "8",
    "--epochs",
    "2",
    "--log-every",
    "1",
    "--num-workers",
    "0",
    "--report-to",
    "none",
    "--no-plots",
]


# --------------------------------------------------------------------------- --eval-samples


def test_eval_subset_is_stratified_by_label_seeded_and_sorted():
    labels = torch.tensor([0] * 600 + [1] * 300 + [2] * 100)[
        torch.randperm(1000, generator=torch.Generator().manual_seed(3))
    ]
    chosen = eval_subset_indices(100, seed=7, labels=labels)
    assert chosen == sorted(set(chosen)) and len(chosen) == 100
    assert torch.bincount(labels[chosen]).tolist() == [60, 30, 10]
    assert chosen == eval_subset_indices(100, seed=7, labels=labels)
    assert chosen != eval_subset_indices(100, seed=8, labels=labels)


def test_eval_subset_gives_the_remainders_to_the_largest_shares():
    labels = torch.tensor([0] * 5 + [1] * 3 + [2] * 2)  # 4 of 10: shares 2.0, 1.2, 0.8
    assert torch.bincount(labels[eval_subset_indices(4, seed=0, labels=labels)], minlength=3).tolist() == [2, 1, 1]


def test_eval_subset_without_labels_is_uniform_and_too_many_is_one_line():
    chosen = eval_subset_indices(5, seed=0, size=50)
    assert len(set(chosen)) == 5 and all(0 <= i < 50 for i in chosen)
    dataset = TensorDataset(torch.arange(50))
    assert eval_subset(dataset, 5, seed=0).indices == chosen
    with pytest.raises(ConfigError, match=r"^--eval-samples 51 is invalid: the eval set has only 50 samples"):
        eval_subset(dataset, 51, seed=0)


def test_eval_samples_flag_is_validated_and_free_on_resume():
    with pytest.raises(ConfigError, match=r"--eval-samples 0 is invalid: must be an integer >= 1"):
        parse_config(TrainConfig, ["--eval-samples", "0"])
    assert parse_config(TrainConfig, ["--eval-samples", "500"]).eval_samples == 500
    assert run_changes({"eval_samples": None}, TrainConfig(eval_samples=500)) == {}


def test_eval_samples_without_an_eval_set_is_refused_before_anything_is_written(tmp_path):
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 2))
    cfg = TrainConfig(eval_samples=5, batch_size=2, max_steps=1, report_to="none", output_dir=str(tmp_path / "run"))
    with pytest.raises(
        ConfigError, match=r"^--eval-samples 5 needs an eval set, and this recipe passes none to fit\(\)$"
    ):
        fit(
            cfg,
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            TensorDataset(torch.zeros(4, 3, 8, 8), torch.zeros(4, dtype=torch.long)),
        )
    assert not (tmp_path / "run").exists()


def test_eval_samples_evaluates_that_many_and_records_it(tmp_path):
    assert run_tiny_in_process(tmp_path / "run", *TINY, "--eval-samples", "20") == 0
    evals = [row for row in read_events(tmp_path / "run") if "eval_samples" in row]
    assert [row["eval_samples"] for row in evals] == [20, 20]
    assert read_summary(tmp_path / "run")["config"]["eval_samples"] == 20


@pytest.mark.slow
@pytest.mark.multiprocess
def test_eval_samples_are_the_same_samples_on_two_processes(tmp_path):
    """2 processes at batch 4 train like 1 at batch 8 (no BatchNorm), so the same 20 samples give the same loss."""
    common = [*TINY, "--eval-samples", "20", "--lr", "0.01", "--no-progress"]
    check(
        launch(
            TINY_RECIPE,
            [*common, "--batch-size", "4", "--output-dir", str(tmp_path / "ddp")],
            processes=2,
            launcher="accelerate",
        )
    )
    check(launch(TINY_RECIPE, [*common, "--output-dir", str(tmp_path / "single")]))
    ddp, single = read_summary(tmp_path / "ddp"), read_summary(tmp_path / "single")
    assert ddp["num_processes"] == 2
    assert [
        row["eval_samples"] for run in ("ddp", "single") for row in read_events(tmp_path / run) if "eval_samples" in row
    ] == [20] * 4
    assert ddp["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-4)


# --------------------------------------------------------------------------- progress


@pytest.mark.slow
def test_evaluation_shows_a_bar_and_the_training_bar_counts_the_evaluations_left(tmp_path, capsys):
    assert run_tiny_in_process(tmp_path / "on", *TINY, "--progress") == 0  # stderr is not a terminal here
    shown = capsys.readouterr().err
    assert "eval: " in shown and "+1 eval ~" in shown  # after the first epoch's evaluation: the final one left
    assert run_tiny_in_process(tmp_path / "off", *TINY, "--no-progress") == 0
    hidden = capsys.readouterr().err
    assert "eval: " not in hidden and "train: " not in hidden


def test_the_training_clock_leaves_evaluations_out(capsys):
    """So the bar's rate and time left are the steps' own, and the evaluations to come are added apart."""
    run = SimpleNamespace(
        accelerator=SimpleNamespace(is_main_process=True),
        cfg=SimpleNamespace(eval_every=2, grad_accum=1),
        batches_per_epoch=10,
        step=2,
        total_steps=6,
    )
    console = Console(progress=True, evaluation=Evaluation(2))
    console.on_fit_start(run)
    started = console.bar.start_t
    run.last_eval_seconds = 0.2  # as Run.evaluate measures it
    console.on_eval_end(run, {})
    assert console.bar.start_t - started >= 0.2 and console.bar.postfix == "+2 evals ~00:00"
    console.on_train_end(run)


@pytest.mark.parametrize(
    "eval_every, step, left", [(None, 0, 2), (None, 3, 1), (None, 6, 0), (4, 0, 3), (4, 8, 1), (4, 10, 0)]
)
def test_the_evaluation_component_counts_the_evaluations_left_on_its_schedule(eval_every, step, left):
    """12 batches per epoch in windows of 5: 3 steps per epoch; 10 steps with --eval-every 4: at 4, 8 and 10."""
    total = 6 if eval_every is None else 10
    run = SimpleNamespace(cfg=SimpleNamespace(grad_accum=5), batches_per_epoch=12, step=step, total_steps=total)
    assert Evaluation(eval_every).left(run) == left


# --------------------------------------------------------------------------- the decode cache


def test_decode_cache_goes_to_acceltrain_cache_says_where_and_shows_a_bar(image_folder, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ACCELTRAIN_CACHE", str(tmp_path / "cache"))
    train, _ = image_datasets("imagefolder", str(image_folder), seed=0)
    images = decoded_images(train.images, 32, progress=True)
    (cache_file,) = (tmp_path / "cache").glob("decoded-*.safetensors")
    out, err = capsys.readouterr()
    assert out == f"decoding 36 image files once into {cache_file} (0.1 MB; ACCELTRAIN_CACHE sets the folder)\n"
    assert "decoding images" in err
    assert not list(image_folder.rglob("*.safetensors")), "nothing is written into the data folder"
    assert torch.equal(images, torch.stack([decode_image_file(path, 32) for path in train.images]))
    assert torch.equal(decoded_images(train.images, 32), images)
    assert capsys.readouterr().out == f"using the 36 images decoded in {cache_file}\n"


def test_decode_cache_defaults_to_the_user_cache_folder(image_folder, tmp_path, monkeypatch):
    monkeypatch.delenv("ACCELTRAIN_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    train, _ = image_datasets("imagefolder", str(image_folder), seed=0)
    decoded_images(train.images, 32)
    assert len(list((tmp_path / "xdg" / "acceltrain").glob("decoded-*.safetensors"))) == 1


def test_an_unwritable_decode_cache_is_one_line_naming_the_way_out(image_folder, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("ACCELTRAIN_CACHE", str(blocker / "cache"))
    train, _ = image_datasets("imagefolder", str(image_folder), seed=0)
    expected = r"^the decoded-image cache '.*a-file/cache' is not a writable folder: set ACCELTRAIN_CACHE to one$"
    with pytest.raises(ConfigError, match=expected):
        decoded_images(train.images, 32)


# --------------------------------------------------------------------------- datasets from the Hub


def write_hub_layout(
    root: Path, *, splits=("train", "test"), label_columns=("label",), label_type: str = "ClassLabel"
) -> Path:
    """A dataset folder as a Hub dataset repo holds it: ``data/<split>-00000-of-00001.parquet``, written by
    ``datasets`` with its features (an Image column, ClassLabel labels) in the parquet metadata."""
    import numpy as np
    from datasets import ClassLabel, Dataset, Image, Value
    from PIL import Image as PILImage

    generator = np.random.default_rng(0)
    for split, count in zip(splits, (30, 9, 9), strict=False):  # two or three splits
        labels = [index % 3 for index in range(count)]
        pictures = [
            PILImage.fromarray((generator.integers(0, 60, (40, 36, 3)) + 80 * label).astype(np.uint8))
            for label in labels
        ]
        dataset = Dataset.from_dict({"img": pictures, **{column: labels for column in label_columns}}).cast_column(
            "img", Image()
        )
        for column in label_columns:
            feature = ClassLabel(names=["cat", "dog", "frog"]) if label_type == "ClassLabel" else Value("int64")
            dataset = dataset.cast_column(column, feature)
        (root / "data").mkdir(parents=True, exist_ok=True)
        dataset.to_parquet(str(root / "data" / f"{split}-00000-of-00001.parquet"))
    return root


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """This process's ``datasets`` offline and caching under tmp_path (it reads the environment at import)."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    return tmp_path / "hf-cache"


@pytest.mark.slow
def test_a_hub_layout_folder_loads_offline_into_uint8_images_with_class_names(tmp_path):
    """In a fresh process with only HF_DATASETS_OFFLINE=1 and HF_HOME, as a user runs after one download; the
    second load of the same dataset comes from the HF cache, and a dataset that is not there is one line."""
    folder = write_hub_layout(tmp_path / "cifar-like")
    script = f"""
import json, torch
from torch.utils.data import TensorDataset

from acceltrain import ConfigError, TrainConfig, fit
from acceltrain.config.parser import parse_config
from acceltrain.config.train_config import run_changes
from acceltrain.vision import image_datasets
train, test = image_datasets({str(folder)!r}, None, seed=0, image_size=32)
again, _ = image_datasets({str(folder)!r}, None, seed=0, image_size=32)
try:
    image_datasets("someone/not-cached-anywhere", None, seed=0)
except ConfigError as err:
    error = str(err)
print(json.dumps({{"shape": list(train.images.shape), "dtype": str(train.images.dtype), "classes": train.classes,
    "labels": train.labels.tolist(), "test": len(test), "same": torch.equal(again.images, train.images), "error": error,
    "sample": train[0][0].shape == (3, 32, 32)}}))
"""
    result = check(
        subprocess.run(
            [sys.executable, "-c", script],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
            env=subprocess_env(HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), HF_DATASETS_CACHE=""),
        )
    )
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["shape"] == [30, 3, 32, 32] and seen["dtype"] == "torch.uint8" and seen["test"] == 9 and seen["sample"]
    assert (
        seen["classes"] == ["cat", "dog", "frog"]
        and seen["labels"] == [index % 3 for index in range(30)]
        and seen["same"]
    )
    assert seen["error"].startswith("--dataset 'someone/not-cached-anywhere' cannot be loaded (")
    assert "HF_DATASETS_OFFLINE=1" in seen["error"] and "\n" not in seen["error"]
    assert list((tmp_path / "hf" / "datasets").rglob("cache-*.arrow")), "the decoded pixels are kept in the HF cache"


def test_hub_images_are_resized_like_image_files(tmp_path, hf_cache):
    from datasets import load_dataset

    train, _ = image_datasets(str(write_hub_layout(tmp_path / "data")), None, seed=0, image_size=16)
    first = load_dataset(str(tmp_path / "data"))["train"][0]["img"]
    first.save(tmp_path / "first.png")
    assert torch.equal(train.images[0], decode_image_file(str(tmp_path / "first.png"), 16))
    assert isinstance(train, ImageClassification) and train.augment is not None and train.image_size == 16


def test_a_hub_dataset_without_an_eval_split_lists_its_splits(tmp_path, hf_cache):
    folder = write_hub_layout(tmp_path / "data", splits=("train",))
    with pytest.raises(
        ConfigError, match=r"^--dataset '.*' has no test or validation split to evaluate on \(it has train\)$"
    ):
        image_datasets(str(folder), None, seed=0)


def test_a_validation_split_is_evaluated_on_when_there_is_no_test_split(tmp_path, hf_cache):
    folder = write_hub_layout(tmp_path / "data", splits=("train", "validation"))
    _, evaluated = image_datasets(str(folder), None, seed=0)
    assert len(evaluated) == 9


@pytest.mark.parametrize(
    "label_columns, label_type, found",
    [(("label",), "int", "no ClassLabel label"), (("fine", "coarse"), "ClassLabel", "2 ClassLabel label")],
)
def test_a_hub_dataset_needs_one_image_and_one_classlabel_column(tmp_path, hf_cache, label_columns, label_type, found):
    folder = write_hub_layout(tmp_path / "data", label_columns=label_columns, label_type=label_type)
    expected = (
        rf"^--dataset '.*' has {found} columns, and acceltrain needs exactly one: its columns are img \(Image\), "
    )
    with pytest.raises(ConfigError, match=expected):
        image_datasets(str(folder), None, seed=0)


def test_data_dir_with_a_hub_dataset_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"^--data-dir is not used by the Hub dataset 'uoft-cs/cifar10'"):
        image_datasets("uoft-cs/cifar10", str(tmp_path), seed=0)


def test_an_unknown_dataset_name_names_the_choices():
    expected = (
        r"^--dataset 'cifar100' is invalid: choose one of cifar10, imagefolder, synthetic, or a Hub dataset as "
        r"namespace/name"
    )
    with pytest.raises(ConfigError, match=expected):
        image_datasets("cifar100", None, seed=0)
