"""Checkpoints that lie: a trainer state or manifest rewritten so that the sha256 check passes, or malformed,
is one line naming the file, the field and what is allowed, never a traceback or a run from step -100.
A failed save says what failed, and blames free space only when the disk is full."""

from __future__ import annotations

import errno
import hashlib
import json
from pathlib import Path

import pytest
from conftest import run_tiny_in_process

from acceltrain.checkpoint.files import complete_checkpoints
from acceltrain.runtime.preemption import EXIT_PREEMPTED

RUN = [
    "--num-train",
    "16",
    "--batch-size",
    "4",
    "--epochs",
    "2",
    "--no-progress",
    "--num-workers",
    "0",
    "--report-to",
    "none",
]


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
    state = json.loads((folder / "trainer_state.json").read_text())
    state.update(fields)
    write_state(folder, json.dumps(state))


def write_state(folder: Path, text: str) -> None:
    """trainer_state.json replaced by ``text``, the manifest rewritten to match."""
    state_file = folder / "trainer_state.json"
    state_file.write_text(text)
    manifest = json.loads((folder / "COMPLETE").read_text())
    manifest["trainer_state.json"] = {
        "bytes": state_file.stat().st_size,
        "sha256": hashlib.sha256(state_file.read_bytes()).hexdigest(),
    }
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
    ({"best_checkpoint": 3}, "has unknown fields: 'best_checkpoint'"),  # a development build's, kept by its hook now
    ({"num_processes": 0}, "num_processes is 0; it must be an integer >= 1"),
    ({"engine": ""}, "engine is ''; it must be one of 'DDP', 'FSDP', 'DeepSpeed'"),
    # the version story (issue 44 item 4): one format, refused in one line when newer, or when absent
    ({"format_version": 2}, "is of format 2, written by a newer acceltrain; this one reads format 1 and older"),
    ({"format_version": None}, "format_version is None; it must be an integer >= 1 (a checkpoint of a development"),
    ({"surprise": 1}, "has unknown fields: 'surprise'"),
    ({"step": "x" * 10_000}, "step is 'xxxxxxxx"),
    # round 4 (issue 31, items 4, 6-8): the fields must agree with each other and the config be whole
    (
        {"step": 100},
        "contradicts itself: step 100 does not follow from epoch 0 and batch_in_epoch 2 (4 optimizer steps per epoch "
        "make step 2)",
    ),
    ({"step": 10**30}, "contradicts itself: step 1000000000000000000000000000000 does not follow"),
    (
        {"batch_in_epoch": 10**6},
        "contradicts itself: batch_in_epoch 1000000 is not an optimizer-step boundary inside an epoch of 4 batches",
    ),
    ({"epoch": 10**6}, "contradicts itself: step 2 does not follow from epoch 1000000"),
    (
        {"samples_seen": 7},
        "contradicts itself: samples_seen 7 does not follow from its position in the data (8 samples)",
    ),
    ({"config": {}}, "config lacks seed, batch_size, grad_accum, epochs, max_steps: it must hold the resolved config"),
    ({"scheduler": {"zzz": 1}}, "scheduler is ['zzz']; it must have the keys"),
    ({"scheduler": {"last_epoch": "x"}}, "scheduler is ['last_epoch']; it must have the keys"),
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


SCHEDULERS = [
    (lambda scheduler: {**scheduler, "last_epoch": "x"}, "scheduler.last_epoch is 'x'; it must be a finite integer"),
    (
        lambda scheduler: {**scheduler, "last_epoch": 3},
        "scheduler.last_epoch is 3; it must be in [0, 2], the steps taken",
    ),
    (
        lambda scheduler: {**scheduler, "base_lrs": [float("nan")]},
        "scheduler.base_lrs[0] is nan; it must be a finite number",
    ),
    (
        lambda scheduler: {**scheduler, "lr_lambdas": [{"total_steps": 1}]},
        "scheduler.lr_lambdas[0] is {'total_steps': 1}; it must be None",
    ),
]


@pytest.mark.parametrize(("tamper", "message"), SCHEDULERS, ids=["string", "ahead", "nan", "lambda-state"])
def test_an_edited_scheduler_state_is_one_line(checkpoint, capsys, tamper, message):
    """Before: torch's load_state_dict took any dict and failed later (KeyError: 'lr_lambdas'), or trained on it."""
    out, folder = checkpoint
    rewrite_state(folder, scheduler=tamper(json.loads((folder / "trainer_state.json").read_text())["scheduler"]))
    assert run_tiny_in_process(out, *RUN, "--resume", str(folder)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: checkpoint file") and message in err and "\n" not in err, err


@pytest.mark.parametrize("field", ["step", "samples_seen", "scheduler", "config", "engine", "num_processes"])
def test_a_missing_field_is_refused_not_defaulted(checkpoint, capsys, field):
    """Before: without "step" a step-2 checkpoint resumed at step 0 and trained 8 more steps."""
    out, folder = checkpoint
    state = json.loads((folder / "trainer_state.json").read_text())
    del state[field]
    write_state(folder, json.dumps(state))
    assert run_tiny_in_process(out, *RUN, "--resume", str(folder)) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"lacks {field}: every checkpoint holds them"), err


@pytest.mark.parametrize("file", ["trainer_state.json", "COMPLETE"])
def test_json_nested_too_deeply_is_unreadable_and_skipped_by_resume_auto(checkpoint, capsys, caplog, file):
    """Before: RecursionError, and --resume auto did not skip the checkpoint either."""
    out, folder = checkpoint
    bomb = "[" * 200_000 + "]" * 200_000
    if file == "COMPLETE":
        (folder / file).write_text(bomb)
    else:
        write_state(folder, bomb)
    assert run_tiny_in_process(out, *RUN, "--resume", str(folder)) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: checkpoint file {str(folder / file)!r} is unreadable", err
    assert run_tiny_in_process(out, *RUN, "--resume", "auto") == 0
    assert f"skipping checkpoint: checkpoint file {str(folder / file)!r} is unreadable" in caplog.text


def test_a_stream_checkpoint_past_the_runs_last_step_is_refused(tmp_path, capsys):
    """Before: a stream checkpoint edited to step 100 of a 12-step run finished at once as "done: 100 steps",
    publishing the step-4 weights. Its fields agree with each other; the run's own length refuses it."""
    out = tmp_path / "run"
    stream = [
        "--stream",
        "torch",
        "--batch-size",
        "8",
        "--max-steps",
        "12",
        "--no-progress",
        "--num-workers",
        "0",
        "--report-to",
        "none",
    ]
    assert run_tiny_in_process(out, *stream, "--stop-after-steps", "4") == EXIT_PREEMPTED
    folder = complete_checkpoints(out)[-1]
    rewrite_state(folder, step=100, samples_seen=800)
    assert run_tiny_in_process(out, *stream, "--resume", "auto") == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(
        "is at step 100, past the 12 optimizer steps of this run: resume with the --max-steps or --epochs it was "
        "written with, or start a new --output-dir"
    ), err
    assert not (out / "summary.json").exists()


@pytest.mark.parametrize(
    ("tamper", "message"), MANIFESTS, ids=["list", "no-bytes", "not-a-dict", "string-bytes", "outside"]
)
def test_a_malformed_manifest_is_one_line(checkpoint, capsys, tamper, message):
    out, folder = checkpoint
    marker = folder / "COMPLETE"
    marker.write_text(json.dumps(tamper(json.loads(marker.read_text()))))
    assert run_tiny_in_process(out, *RUN, "--resume", str(folder)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: checkpoint file") and message in err and "\n" not in err, err


def test_a_trainer_state_that_is_not_an_object_is_one_line(checkpoint, capsys):
    out, folder = checkpoint
    write_state(folder, "[1, 2]")
    assert run_tiny_in_process(out, *RUN, "--resume", str(folder)) == 2
    assert "is malformed: a JSON list, not an object" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("error", "free_space"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), True),
        (OSError(errno.EACCES, "Permission denied"), False),
        (RuntimeError("Some tensors share memory, this will lead to duplicate memory on disk"), False),
    ],
    ids=["ENOSPC", "EACCES", "shared-tensors"],
)
def test_a_failed_save_blames_free_space_only_for_a_full_disk(tmp_path, monkeypatch, capsys, error, free_space):
    from acceltrain.checkpoint import writers

    def fails(part, folder, process_group=None):
        raise error

    monkeypatch.setattr(writers, "write_part", fails)
    out = tmp_path / "run"
    assert run_tiny_in_process(out, *RUN, "--save-every-steps", "2") == 2
    err = capsys.readouterr().err.strip()
    assert "could not write checkpoint" in err and first_words(error) in err and "\n" not in err, err
    assert ("free space" in err) == free_space, err
    assert not list((out / "checkpoints").glob(".tmp-*"))


def first_words(error: Exception) -> str:
    return (getattr(error, "strerror", None) or str(error))[:20]
