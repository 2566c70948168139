"""A checkpoint's files: written into a temporary folder, published complete (a manifest of every file's size and
sha256 written last, then one atomic rename) or not at all, verified against the manifest before a resume, found
(the newest that verifies) and rotated (keep-last, never the best)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from acceltrain.checkpoint.safe_load import SHARD_DIGESTS_FILE, shard_digests
from acceltrain.checkpoint.state import STATE_FILE, CheckpointError, RunState, is_count, read_state
from acceltrain.config.options import first_line, parse_json, shorten
from acceltrain.runtime.run_folder import CHECKPOINTS_DIR

COMPLETE_FILE = "COMPLETE"  # the manifest, written last: a checkpoint without it is incomplete


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return output_dir / CHECKPOINTS_DIR / f"step_{step:08d}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)
    descriptor = os.open(path, flags)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def staging_folder(accelerator, output_dir: Path, step: int) -> tuple[Path, Path]:
    """(the checkpoint's final folder, the empty temporary one it is written in), agreed by all processes."""
    final = checkpoint_dir(output_dir, step)
    staging = final.with_name(f".tmp-{final.name}")
    if accelerator.is_main_process and staging.exists():
        shutil.rmtree(staging)
    accelerator.wait_for_everyone()
    return final, staging


@contextlib.contextmanager
def failed_save_refused(final: Path, staging: Path):
    """A save that fails (a full disk) removes its temporary folder and is one line:
    the previous checkpoints are intact."""
    try:
        yield
    except CheckpointError:  # the writer's own verdict, agreed by every process
        shutil.rmtree(staging, ignore_errors=True)
        raise
    except (OSError, RuntimeError, ValueError) as err:  # torch reports a full disk from C++ as a RuntimeError
        refusal = failed_save(final, err)  # before the temporary folder's bytes are freed: a full disk shows
        shutil.rmtree(staging, ignore_errors=True)
        raise refusal from None


NEARLY_FULL_BYTES = 1 << 20  # less free than this after a failed write: the disk filled up, whatever torch said


def failed_save(final: Path, err: BaseException) -> CheckpointError:
    """One line for a save that failed; a full disk is named as such even when the writer did not say so (torch's
    zip writer reports one as "unexpected pos N vs M"), measured while the failed save's bytes are still on it."""
    try:
        free = shutil.disk_usage(final.parent).free
    except OSError:
        free = None
    full = free is not None and free < NEARLY_FULL_BYTES
    cause = first_line(err)
    if full:
        cause = f"the disk holding {str(final.parent)!r} is full ({free:,} bytes free; {cause})"
    way_out = (
        "free space and continue with --resume auto"
        if full or _out_of_space(err)
        else "continue with --resume auto once it is mended"
    )
    return CheckpointError(
        f"could not write checkpoint {str(final)!r}: {cause}; the previous checkpoints are intact ({way_out})"
    )


def publish(staging: Path, final: Path) -> None:
    """Once every process's files are in ``staging``: the manifest (size and sha256 of every file), fsync, and
    one atomic rename to ``final``: the checkpoint exists complete, or not at all. DCP shards get their items'
    digests first (:func:`~.safe_load.shard_digests`)."""
    digests = shard_digests(staging)
    if digests:
        (staging / SHARD_DIGESTS_FILE).write_text(json.dumps(digests, indent=1))
    manifest = {}
    for file in sorted(p for p in staging.rglob("*") if p.is_file()):
        _fsync(file)
        manifest[str(file.relative_to(staging))] = {"bytes": file.stat().st_size, "sha256": _sha256(file)}
    (staging / COMPLETE_FILE).write_text(json.dumps(manifest, indent=1))
    _fsync(staging / COMPLETE_FILE)
    _fsync(staging)
    if final.exists():  # the same step saved before (e.g. a run resumed from an older checkpoint)
        shutil.rmtree(final)
    os.replace(staging, final)
    _fsync(final.parent)


def _out_of_space(err: Exception) -> bool:
    """A full disk or quota: ENOSPC/EDQUOT, or torch's C++ writer's "file write failed", which carries no errno."""
    if isinstance(err, OSError):
        return err.errno in (errno.ENOSPC, errno.EDQUOT)
    return "file write failed" in str(err) or "No space left" in str(err)


def verify_checkpoint(path: Path) -> RunState:
    """The checkpoint's run state, after checking every file against the manifest; else CheckpointError."""
    if not path.is_dir():
        raise CheckpointError(f"--resume {str(path)!r}: no such checkpoint folder")
    marker = path / COMPLETE_FILE
    if not marker.is_file():
        raise CheckpointError(
            f"checkpoint {str(path)!r} is incomplete: {COMPLETE_FILE} is missing (the save did not finish)"
        )
    try:
        manifest = parse_json(marker.read_text())
    except (OSError, ValueError):
        raise CheckpointError(f"checkpoint file {str(marker)!r} is unreadable") from None
    for name, expected in _manifest_entries(manifest, marker):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {str(file)!r} is missing")
        if file.stat().st_size != expected["bytes"]:
            raise CheckpointError(
                f"checkpoint file {str(file)!r} is truncated ({file.stat().st_size} of {expected['bytes']} bytes)"
            )
        if _sha256(file) != expected["sha256"]:
            raise CheckpointError(f"checkpoint file {str(file)!r} is corrupted (sha256 differs from the manifest)")
    return read_state(path / STATE_FILE)


def _manifest_entries(manifest, marker: Path) -> list[tuple[str, dict]]:
    """The manifest's (file, {bytes, sha256}) entries, each checked for shape: a tampered manifest is one line."""

    def malformed(what: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint file {str(marker)!r} is malformed: {what}; it must map each file to its bytes and sha256"
        )

    if not isinstance(manifest, dict):
        raise malformed(f"a JSON {type(manifest).__name__}, not an object")
    for name, entry in manifest.items():
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise malformed(f"entry {shorten(name)} points outside the checkpoint")
        if not (isinstance(entry, dict) and is_count(entry.get("bytes")) and isinstance(entry.get("sha256"), str)):
            raise malformed(f"entry {shorten(name)} is {shorten(entry)}")
    return list(manifest.items())


_CHECKPOINT_NAME = re.compile(r"step_(\d+)")


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """``step_<N>`` folders that carry a manifest, oldest first (by step, not by name or mtime). Anything
    else in the folder (``step_10.bak``, your notes) is not a checkpoint and is left alone."""
    folder = output_dir / CHECKPOINTS_DIR
    if not folder.is_dir():
        return []
    found = [
        p
        for p in folder.iterdir()
        if _CHECKPOINT_NAME.fullmatch(p.name) and p.is_dir() and (p / COMPLETE_FILE).is_file()
    ]
    return sorted(found, key=lambda p: int(_CHECKPOINT_NAME.fullmatch(p.name).group(1)))


def find_resume_checkpoint(resume: str, output_dir: Path, warn) -> tuple[Path, RunState] | None:
    """``--resume PATH``: that checkpoint or a one-line error. ``--resume auto``: the newest checkpoint
    that verifies, warning about (and skipping) newer broken ones; None when there is none. With the
    checkpoint: its run state (see :func:`verify_checkpoint`)."""
    if resume != "auto":
        path = Path(resume)
        return path, verify_checkpoint(path)
    candidates = list(reversed(complete_checkpoints(output_dir)))
    for path in candidates:
        try:
            return path, verify_checkpoint(path)
        except CheckpointError as err:
            warn(f"skipping checkpoint: {err}")
    return None


def rotate_checkpoints(output_dir: Path, keep_last: int | None, best: str | None, verified: set[str]) -> list[Path]:
    """Delete leftovers of interrupted saves, and complete checkpoints older than the newest ``keep_last``
    ones that verify, never the best one. A broken checkpoint never counts as one of the newest (it
    would push good ones out); a broken one newer than those kept is left for ``--resume auto`` to skip
    and name. ``verified``: names known good (written by this run, or checked before); extended here,
    so each checkpoint is hashed at most once per run. Returns what was deleted."""
    deleted = []
    for leftover in (output_dir / CHECKPOINTS_DIR).glob(".tmp-step_*"):
        shutil.rmtree(leftover, ignore_errors=True)
        deleted.append(leftover)
    if keep_last is None:
        return deleted
    kept = 0
    for path in reversed(complete_checkpoints(output_dir)):
        if kept < keep_last:
            if path.name not in verified:
                try:
                    verify_checkpoint(path)
                except CheckpointError:
                    continue
                verified.add(path.name)
            kept += 1
        elif path.name != best:
            shutil.rmtree(path)
            deleted.append(path)
    return deleted


def checkpoint_engine(path: Path, state: RunState | None = None) -> str:
    """The engine that wrote checkpoint ``path``, as its trainer state records it: "DDP" (whole state dicts, as DDP
    and one process write them), "FSDP" or "DeepSpeed". Each loads only under its own engine."""
    return (state or read_state(path / STATE_FILE)).engine
