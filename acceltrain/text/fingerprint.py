"""What the training data's content is, as a string a checkpoint records: a resume refuses data that changed since
(a stream has no length to compare, and a table may change without changing its row count)."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

FINGERPRINT_WHOLE_BYTES = 1 << 30  # text hashed whole up to 1 GiB; beyond, each file's size and ends
FINGERPRINT_END_BYTES = 1 << 20


def text_fingerprint(files: list[str]) -> str:
    """A sha256 of the text files' sizes and contents, in order: a resume refuses text that changed (a stream has no
    length to compare). Past 1 GiB in all, each file's size and first and last MiB: hashing all of it would take
    minutes each launch."""
    import hashlib

    sizes = [os.path.getsize(path) for path in files]
    whole = sum(sizes) <= FINGERPRINT_WHOLE_BYTES
    digest = hashlib.sha256(f"{whole}:{sizes}".encode())
    for path, size in zip(files, sizes, strict=True):
        with open(path, "rb") as file:
            if whole or size <= 2 * FINGERPRINT_END_BYTES:
                for block in iter(lambda: file.read(FINGERPRINT_END_BYTES), b""):
                    digest.update(block)
            else:
                digest.update(file.read(FINGERPRINT_END_BYTES))
                file.seek(size - FINGERPRINT_END_BYTES)
                digest.update(file.read())
    if not whole:
        logger.info(
            f"the text's fingerprint covers each file's size and first and last MiB ({sum(sizes) / 2**30:.1f} GiB "
            "in all): a change elsewhere with the same size would not be noticed on resume"
        )
    return digest.hexdigest()


def file_fingerprint(*paths: str | None) -> str:
    """The files' content fingerprint (:func:`text_fingerprint`): a resume refuses data that changed."""
    return text_fingerprint([os.path.abspath(os.path.expanduser(path)) for path in paths if path is not None])
