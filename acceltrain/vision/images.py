"""Image files: decoded to uint8 CHW tensors, and checked before training (a file that is empty, not an image, cut
short, or a link to nothing is named in one line, never met mid-run)."""

from __future__ import annotations

import os
import stat

import torch

from acceltrain.config.options import ConfigError, first_line


class UnreadableImage(ConfigError):
    """An image file that cannot be decoded, found at its first read (damage the scan cannot see). One line
    also when raised in a DataLoader worker, which re-raises it with the worker's traceback as its text."""

    def __init__(self, message: str):
        if "Original Traceback" in message:  # torch's ExceptionWrapper.reraise: keep the original one line
            message = message.rstrip().splitlines()[-1].removeprefix(f"{__name__}.").removeprefix("UnreadableImage: ")
        super().__init__(message)


def decode_image_file(path: str, image_size: int) -> torch.Tensor:
    """An image file as a uint8 RGB CHW tensor of ``image_size`` x ``image_size`` (resized when it differs)."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            return torch.from_numpy(rgb_chw(image, image_size))
    except (OSError, SyntaxError, ValueError) as err:  # PIL reports damaged data as any of these
        raise UnreadableImage(
            f"image file {path!r} cannot be decoded ({first_line(err)}): remove or replace it"
        ) from None


def rgb_chw(image, image_size: int):
    """A PIL image as a uint8 RGB (3, S, S) numpy array, resized (bilinear) when its size is not S x S: the
    one conversion of image files and Hub datasets' images alike. 16-bit grayscale (PIL's ``I;16`` and ``I``
    modes) is scaled to 8 bits first: ``convert`` would clip it, nearly every pixel white."""
    import numpy as np
    from PIL import Image

    if image.mode.startswith("I"):
        image = Image.fromarray((np.asarray(image).clip(0, 65535) >> 8).astype(np.uint8))
    image = image.convert("RGB")
    if image.size != (image_size, image_size):
        image = image.resize((image_size, image_size), Image.Resampling.BILINEAR)
    return np.ascontiguousarray(np.asarray(image).transpose(2, 0, 1))


def unreadable_reason(path: str) -> str | None:
    """Why ``path`` is no usable image, or None. Cheap enough for every file of a tree: ``stat`` (a symlink
    loop, a dangling link, a folder named like an image, an empty file), the header (not an image), and the
    end marker of JPEG and PNG files (a copy cut short); only a file without that marker, or of another
    format, is decoded in full, to be sure."""
    from PIL import Image

    try:
        status = os.stat(path)
        if not stat.S_ISREG(status.st_mode):
            return "not a file"
        if status.st_size == 0:
            return "empty file"
        with Image.open(path) as image:
            if not _ends_completely(path, image.format):
                image.load()
    except Image.UnidentifiedImageError:
        return "not an image"
    except (OSError, SyntaxError, ValueError) as err:
        return first_line(err)
    return None


def _ends_completely(path: str, image_format: str | None) -> bool:
    if image_format not in ("JPEG", "PNG"):
        return False
    with open(path, "rb") as file:
        file.seek(max(0, os.path.getsize(path) - 64))
        tail = file.read()
    return b"\xff\xd9" in tail if image_format == "JPEG" else tail.endswith(b"IEND\xaeB`\x82")
