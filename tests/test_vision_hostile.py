"""Hostile inputs to the vision data path (issue 20, round 3): a decode cache that does not hold what its
name says is decoded again, never trained on; 16-bit PNGs keep their values; the image-file check and
decode bars follow --progress / --no-progress."""

from __future__ import annotations

import hashlib
import struct
import zlib

import numpy as np
import pytest
import torch
from conftest import reset_accelerate_state
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file

from acceltrain import run_recipe
from acceltrain.recipes.resnet_cifar import CifarConfig
from acceltrain.recipes.resnet_cifar import main as cifar_main
from acceltrain.vision import data, image_datasets
from acceltrain.vision.device_loader import decoded_images
from acceltrain.vision.images import decode_image_file, rgb_chw

# --------------------------------------------------------------------------- the decode cache


def _forge(cache_file, images: torch.Tensor, metadata: dict) -> None:
    """Write ``images`` as the cache with ``metadata``, its content hash (if any) made to fit them, so that
    only what the case changes differs from a good cache."""
    if "sha256" in metadata:
        metadata = {**metadata, "sha256": hashlib.sha256(images.contiguous().numpy()).hexdigest()}
    save_file({"images": images.contiguous()}, str(cache_file), metadata=metadata)


def _tamper(case: str, cache_file, good: torch.Tensor) -> None:
    with safe_open(str(cache_file), framework="pt") as cached:
        metadata = cached.metadata()
    if case == "shape":  # the same fingerprint, 8x8 zeros: trained silently before
        _forge(cache_file, torch.zeros(len(good), 3, 8, 8, dtype=torch.uint8), metadata)
    elif case == "more images":  # more images than files: an IndexError before
        _forge(cache_file, torch.cat([good, good[:4]]), metadata)
    elif case == "fewer images":
        _forge(cache_file, good[:-4], metadata)
    elif case == "dtype":
        _forge(cache_file, good.float(), metadata)
    elif case == "content":  # same shape, other bytes, the hash of the good images
        save_file({"images": 255 - good}, str(cache_file), metadata=metadata)
    elif case == "old cache":  # written before the content hash: fingerprint only
        save_file({"images": good}, str(cache_file), metadata={"fingerprint": metadata["fingerprint"]})
    elif case == "no metadata":
        save_file({"images": good}, str(cache_file))
    elif case == "garbage":
        cache_file.write_bytes(b"\x00\xff not a safetensors file " * 100)


@pytest.mark.parametrize(
    "case", ["shape", "more images", "fewer images", "dtype", "content", "old cache", "no metadata", "garbage"]
)
def test_a_decode_cache_that_does_not_match_is_decoded_again_and_says_so(image_folder, tmp_path, capsys, case):
    train, _ = image_datasets("imagefolder", str(image_folder), seed=0)
    fresh = torch.stack([decode_image_file(path, 32) for path in train.images])
    cache = tmp_path / "cache"
    decoded_images(train.images, 32, cache)
    (cache_file,) = cache.glob("decoded-*.safetensors")
    _tamper(case, cache_file, fresh)
    capsys.readouterr()

    assert torch.equal(decoded_images(train.images, 32, cache), fresh)
    (line,) = capsys.readouterr().out.splitlines()
    assert (
        line.startswith(f"warning: the decoded-image cache {cache_file} does not match (")
        and "decoding the 36 images again" in line
    )
    assert torch.equal(decoded_images(train.images, 32, cache), fresh), "rewritten: read back as it is"
    assert capsys.readouterr().out == f"using the 36 images decoded in {cache_file}\n"
    assert list(cache.iterdir()) == [cache_file], "no temporary file left behind"


# --------------------------------------------------------------------------- 16-bit images

RAMP = np.arange(32 * 32, dtype=np.uint16).reshape(32, 32) * 64  # 0 .. 65472


def _rgb16_png(path, rgb: np.ndarray) -> None:
    """A 48-bit RGB PNG, by hand: PIL writes none."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    rows = b"".join(b"\x00" + row.astype(">u2").tobytes() for row in rgb)
    header = struct.pack(">IIBBBBB", rgb.shape[1], rgb.shape[0], 16, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize("kind", ["16-bit grayscale PNG", "mode I", "48-bit RGB PNG"])
def test_16_bit_images_are_scaled_to_8_bits_not_saturated(tmp_path, kind):
    path = tmp_path / "deep.png"
    if kind == "16-bit grayscale PNG":
        Image.fromarray(RAMP).save(path)  # mode I;16
        decoded = decode_image_file(str(path), 32).numpy()
    elif kind == "mode I":
        decoded = rgb_chw(Image.fromarray(RAMP.astype(np.int32)), 32)
    else:
        _rgb16_png(path, np.stack([RAMP, RAMP, RAMP], axis=-1))
        decoded = decode_image_file(str(path), 32).numpy()
    assert decoded.shape == (3, 32, 32)
    assert np.abs(decoded.astype(int) - (RAMP >> 8)).max() <= 1


# --------------------------------------------------------------------------- progress bars

BARS = ("checking image files", "decoding images")


@pytest.fixture
def check_bar_on_small_trees(monkeypatch):
    monkeypatch.setattr(data, "CHECK_BAR_MIN_FILES", 0)  # the check draws its bar from 10,000 files only


@pytest.mark.parametrize("progress, drawn", [(False, False), (None, False), (True, True)])
def test_the_check_and_decode_bars_follow_progress(
    image_folder, tmp_path, capsys, check_bar_on_small_trees, progress, drawn
):
    """None (no flag): bars only on a terminal, and pytest's stderr is none."""
    train, _ = image_datasets("imagefolder", str(image_folder), seed=0, progress=progress)
    train.cache_dir = str(tmp_path)
    train.decoded()
    err = capsys.readouterr().err
    assert all((bar in err) == drawn for bar in BARS), err


@pytest.mark.parametrize("flag, drawn", [("--no-progress", False), ("--progress", True)])
def test_the_recipe_passes_progress_to_the_image_data(
    image_folder, tmp_path, monkeypatch, capsys, check_bar_on_small_trees, flag, drawn
):
    monkeypatch.setenv("ACCELTRAIN_CACHE", str(tmp_path / "cache"))
    reset_accelerate_state()
    run_recipe(
        cifar_main,
        CifarConfig,
        [
            "--dataset",
            "imagefolder",
            "--data-dir",
            str(image_folder),
            "--model",
            "resnet_tiny",
            "--batch-size",
            "6",
            "--max-steps",
            "1",
            "--data-on-device",
            "--num-workers",
            "0",
            "--report-to",
            "none",
            "--output-dir",
            str(tmp_path / "run"),
            flag,
        ],
    )
    err = capsys.readouterr().err
    assert all((bar in err) == drawn for bar in BARS), err
