"""Checkpoints that lie: a trainer state or manifest rewritten so that the sha256 check passes, or malformed,
is one line naming the file, the field and what is allowed, never a traceback or a run from step -100.
A failed save says what failed, and blames free space only when the disk is full."""

from __future__ import annotations

import errno
import hashlib
import json
from pathlib import Path

import pytest

from acceltrain.checkpointing import EXIT_PREEMPTED, complete_checkpoints
from conftest import run_tiny_in_process

RUN = ["--num-train", "16", "--batch-size", "4", "--epochs", "2", "--no-progress", "--num-workers", "0", "--report-to", "none"]


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("stopped") / "run"
    assert run_tiny_in_process(out, *RUN, "--stop-after-steps", "2") == EXIT_PREEMPTED
    return out


@pytest.fixture
def checkpoint(stopped_run, tmp_path):
    """A copy of the stopped run, to tamper with."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(stopped_run, out)
    return out, complete_checkpoints(out)[-1]


def rewrite_state(folder: Path, **fields) -> None:
    """Change trainer_state.json and rewrite the manifest to match: the integrity check passes."""
    state_file = folder / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state.update(fields)
    state_file.write_text(json.dumps(state))
    manifest = json.loads((folder / "COMPLETE").read_text())
    manifest["trainer_state.json"] = {"bytes": state_file.stat().st_size, "sha256": hashlib.sha256(state_file.read_bytes()).hexdigest()}
    (folder / "COMPLETE").write_text(json.dumps(manifest))


STATES = [
    ({"step": -100}, "step is -100; it must be an integer >= 0"),
    ({"step": "3"}, "step is '3'; it must be an integer >= 0"),
    ({"step": True}, "step is True; it must be an integer >= 0"),
    ({"epoch": 1.5}, "epoch is 1.5; it must be an integer >= 0"),
    ({"grad_accum": 0}, "grad_accum is 0; it must be an integer >= 1"),
    ({"train_seconds": -1.0}, "train_seconds is -1.0; it must be a finite number >= 0"),
    ({"hooks": "EMA"}, "hooks is 'EMA'; it must be a list of hook names"),
    ({"scheduler": []}, "scheduler is []; it must be a JSON object"),
    ({"best_checkpoint": 3}, "best_checkpoint is 3; it must be a string or null"),  # a field of checkpoints before RunState
    ({"batches_in_epoch": 0}, "has both batch_in_epoch and batches_in_epoch, its older name: keep one"),
    ({"surprise": 1}, "has unknown fields: 'surprise'"),
    ({"step": "x" * 10_000}, "step is 'xxxxxxxx"),
]


@pytest.mark.parametrize(("fields", "message"), STATES, ids=[str(i) for i in range(len(STATES))])
def test_a_tampered_trainer_state_is_one_line(checkpoint, capsys, fields, message):
    out, folder = checkpoint
    rewrite_state(folder, **fields)
    assert run_tiny_in_process(out, *RUN, "--resume", str(folder)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: checkpoint file") and message in err and "\n" not in err and len(err) < 400, err
    assert not list((out / "checkpoints").glob("step_-*")), "never trains from a negative step"


MANIFESTS = [
    (lambda manifest: list(manifest), "is malformed: a JSON list, not an object"),
    (lambda manifest: {name: {"sha256": entry["sha256"]} for name, entry in manifest.items()}, "is malformed: entry"),
    (lambda manifest: {name: "big" for name in manifest}, "is malformed: entry"),
    (lambda manifest: {name: {**entry, "bytes": "12"} for name, entry in manifest.items()}, "is malformed: entry"),
    (lambda manifest: {**manifest, "../../outside": {"bytes": 1, "sha256": "0"}}, "points outside the checkpoint"),
]


@pytest.mark.parametrize(("tamper", "message"), MANIFESTS, ids=["list", "no-bytes", "not-a-dict", "string-bytes", "outside"])
def test_a_malformed_manifest_is_one_line(checkpoint, capsys, tamper, message):
    out, folder = checkpoint
    marker = folder / "COMPLETE"
    marker.write_text(json.dumps(tamper(json.loads(marker.read_text()))))
    assert run_tiny_in_process(out, *RUN, "--resume", str(folder)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: checkpoint file") and message in err and "\n" not in err, err


def test_a_trainer_state_that_is_not_an_object_is_one_line(checkpoint, capsys):
    out, folder = checkpoint
    state_file = folder / "trainer_state.json"
    state_file.write_text("[1, 2]")
    manifest = json.loads((folder / "COMPLETE").read_text())
    manifest["trainer_state.json"] = {"bytes": state_file.stat().st_size, "sha256": hashlib.sha256(state_file.read_bytes()).hexdigest()}
    (folder / "COMPLETE").write_text(json.dumps(manifest))
    assert run_tiny_in_process(out, *RUN, "--resume", str(folder)) == 2
    assert "is malformed: a JSON list, not an object" in capsys.readouterr().err


@pytest.mark.parametrize(("error", "free_space"), [
    (OSError(errno.ENOSPC, "No space left on device"), True),
    (OSError(errno.EACCES, "Permission denied"), False),
    (RuntimeError("Some tensors share memory, this will lead to duplicate memory on disk"), False),
], ids=["ENOSPC", "EACCES", "shared-tensors"])
def test_a_failed_save_blames_free_space_only_for_a_full_disk(tmp_path, monkeypatch, capsys, error, free_space):
    import accelerate

    def fails(self, output_dir=None, **kwargs):
        raise error

    monkeypatch.setattr(accelerate.Accelerator, "save_state", fails)
    out = tmp_path / "run"
    assert run_tiny_in_process(out, *RUN, "--save-every-steps", "2") == 2
    err = capsys.readouterr().err.strip()
    assert "could not write checkpoint" in err and first_words(error) in err and "\n" not in err, err
    assert ("free space" in err) == free_space, err
    assert not list((out / "checkpoints").glob(".tmp-*"))


def first_words(error: Exception) -> str:
    return (getattr(error, "strerror", None) or str(error))[:20]
