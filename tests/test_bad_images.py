"""Unusable image files in an ImageFolder tree get one line naming the file and the way out, before any
training (the scan), or at first read for damage the scan cannot see; --skip-bad-images trains without them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from acceltrain.config.options import ConfigError
from acceltrain.vision import image_datasets
from acceltrain.vision.data import scan_image_folder
from acceltrain.vision.images import UnreadableImage, decode_image_file

REPO = Path(__file__).resolve().parents[1]


def _plant(root: Path, case: str) -> Path:
    """One bad entry of kind ``case`` in ``test/cat/`` (found only after a whole epoch before the scan)."""
    folder = root / "test" / "cat"
    good = sorted(folder.iterdir())[0].read_bytes()
    target = folder / f"bad-{case}.jpg"
    if case == "truncated":
        target.write_bytes(good[: len(good) // 2])
    elif case == "zero-byte":
        target.write_bytes(b"")
    elif case == "not-an-image":
        target.write_text("this is a text file with an image's name\n")
    elif case == "symlink-loop":
        os.symlink(folder / "loop.jpg", folder / "loop.jpg")
        target = folder / "loop.jpg"
    elif case == "folder":
        target = folder / "x.png"
        target.mkdir()
    return target


@pytest.mark.parametrize("case", ["truncated", "zero-byte", "not-an-image", "symlink-loop", "folder"])
def test_each_kind_of_bad_file_is_one_line_naming_it_before_training(image_folder, case):
    bad = _plant(image_folder, case)
    with pytest.raises(ConfigError) as raised:
        scan_image_folder(str(image_folder))
    message = str(raised.value)
    assert "\n" not in message
    assert str(bad.relative_to(image_folder)) in message and "--skip-bad-images" in message


def test_skip_bad_images_drops_them_and_says_how_many(image_folder, capsys):
    _plant(image_folder, "truncated")
    _plant(image_folder, "zero-byte")
    (image_folder / "train" / "dog" / "notes.png").write_text("not an image")
    train, evaluation = image_datasets("imagefolder", str(image_folder), seed=0, skip_bad_images=True)
    assert (len(train), len(evaluation)) == (36, 12)
    out = capsys.readouterr().out
    assert "skipped 3 unreadable image files" in out and "bad-truncated.jpg" in out


def test_a_healthy_tree_passes_and_a_png_cut_short_is_caught_but_one_only_missing_its_end_chunk_is_not(image_folder):
    splits = scan_image_folder(str(image_folder))
    assert len(splits["train"][0]) == 36
    from PIL import Image

    pixels = torch.randint(0, 255, (64, 64, 3), generator=torch.Generator().manual_seed(0), dtype=torch.uint8).numpy()
    png = image_folder / "train" / "cat" / "no-end.png"
    Image.fromarray(pixels).save(png)
    png.write_bytes(png.read_bytes()[:-12])  # all pixels there, only IEND missing: decodes, so it is kept
    assert str(png) in scan_image_folder(str(image_folder))["train"][0]
    png.write_bytes(png.read_bytes()[: len(png.read_bytes()) * 3 // 5])  # a copy cut short
    with pytest.raises(ConfigError, match="no-end.png"):
        scan_image_folder(str(image_folder))


def test_a_single_class_tree_is_refused(image_folder):
    for split in ("train", "test"):
        for name in ("dog", "frog"):
            for path in (image_folder / split / name).iterdir():
                path.unlink()
            (image_folder / split / name).rmdir()
    with pytest.raises(ConfigError, match="only one class folder 'cat'"):
        scan_image_folder(str(image_folder))


def test_damage_the_scan_cannot_see_is_one_line_at_first_read_also_from_a_worker(image_folder):
    """A PNG with its header and end chunk intact and zeros in its pixel data: only decoding finds it."""
    from PIL import Image

    path = image_folder / "train" / "cat" / "damaged.png"
    Image.fromarray(torch.randint(0, 255, (64, 64, 3), dtype=torch.uint8).numpy()).save(path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 100] = bytes(100)
    path.write_bytes(bytes(data))
    with pytest.raises(UnreadableImage) as raised:
        decode_image_file(str(path), 32)
    assert "\n" not in str(raised.value) and "damaged.png" in str(raised.value)
    train, _ = image_datasets("imagefolder", str(image_folder), seed=0)
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(train, [train.images.index(str(path))]), num_workers=1)
    with pytest.raises(UnreadableImage) as raised:
        next(iter(loader))
    assert "\n" not in str(raised.value) and "damaged.png" in str(raised.value)


@pytest.mark.slow
def test_the_recipe_prints_one_line_exits_2_and_writes_nothing(image_folder, tmp_path):
    _plant(image_folder, "truncated")
    output = tmp_path / "out"
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "recipes" / "resnet_cifar.py"),
            "--dataset",
            "imagefolder",
            "--data-dir",
            str(image_folder),
            "--model",
            "resnet_tiny",
            "--max-steps",
            "2",
            "--output-dir",
            str(output),
            "--report-to",
            "none",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0 and "test/cat/bad-truncated.jpg" in result.stderr
    assert not output.exists()
