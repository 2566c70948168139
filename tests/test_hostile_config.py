"""Hostile inputs, round 3 (issue 20): presets that expand, block or do not decode, bad W&B environment
variables, a broken DeepSpeed JSON, and a stop to be resumed as torchelastic's launcher reports it.
Each is one short line on stderr and exit 2 before training (or, for the stop, the launcher's report)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import REPO, TINY_RECIPE, check, launch, run_tiny_in_process, subprocess_env

from acceltrain import ConfigError, TrainConfig, parse_config
from acceltrain.engines.deepspeed import deepspeed_plugin
from acceltrain.runtime.tracking import read_offline_run

TINY = ["--batch-size", "8", "--no-progress", "--num-workers", "0"]


def one_line_error(capsys, code: int, out=None) -> str:
    """The failed run's stderr: one short ``error:`` line, exit 2, nothing written."""
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and len(err) < 500, err[:2000]
    assert out is None or not out.exists(), "bad input must not write anything"
    return err


def alias_bomb(levels: int = 7) -> str:
    """Nine ``x`` at the first level, each next level nine aliases of the one before: 9**levels values."""
    anchors = ["&l0 [x, x, x, x, x, x, x, x, x]"] + [
        f"&l{n} [{', '.join([f'*l{n - 1}'] * 9)}]" for n in range(1, levels)
    ]
    return "[" + ", ".join(anchors) + "]"


@pytest.mark.parametrize(
    "text,message",
    [
        (f"lr: {alias_bomb()}\n", "more than 10,000 keys and values"),  # a one-value field given a list
        (f"wandb_tags: {alias_bomb()}\n", "more than 10,000 keys and values"),  # a list-like field
        ("lr: &loop [*loop]\n", "more than 10,000 keys and values"),  # a list that holds itself
        ("lr: " + "[" * 100_000 + "]" * 100_000 + "\n", "nested too deeply"),  # RecursionError in PyYAML
        ("lr: [" + ", ".join(["x" * 100] * 5000) + "]\n", "--lr ['xxxxxxxx"),  # big but bounded: echoed cut short
    ],
    ids=["alias-bomb", "alias-bomb-list-field", "recursive", "deep", "long-value"],
)
def test_a_preset_that_expands_is_one_short_line_in_seconds(tmp_path, capsys, text, message):
    preset = tmp_path / "preset.yaml"
    preset.write_text(text)
    started = time.monotonic()
    code = run_tiny_in_process(tmp_path / "out", "--config", str(preset))
    assert message in one_line_error(capsys, code, tmp_path / "out")
    assert time.monotonic() - started < 60, "hung"  # a hang guard (about 1 s idle): the message shows the limit held


def test_a_value_echoed_in_an_error_is_cut_short():
    with pytest.raises(ConfigError) as err:
        TrainConfig(batch_size=-(10**200)).validate()
    assert len(str(err.value)) < 200 and "is invalid: must be an integer >= 1" in str(err.value)


def test_a_preset_with_thousands_of_unknown_keys_names_a_few(tmp_path):
    preset = tmp_path / "preset.yaml"
    preset.write_text("".join(f"key{i}: 1\n" for i in range(3000)))
    with pytest.raises(ConfigError) as err:
        parse_config(TrainConfig, ["--config", str(preset)])
    assert len(str(err.value)) < 500 and "and 2990 more" in str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fifo", "directory", "/dev/zero"])
def test_a_preset_that_is_not_a_regular_file_is_refused_at_once(tmp_path, kind):
    """A FIFO blocked the read for good (a subprocess, so that the test ends even then); /dev/zero never ends."""
    path = {"fifo": tmp_path / "preset.yaml", "directory": tmp_path, "/dev/zero": "/dev/zero"}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    try:
        result = launch(TINY_RECIPE, ["--config", str(path), "--output-dir", str(tmp_path / "out")], timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"--config {kind} still blocks")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr[-2000:]
    assert result.stderr.startswith(f"error: --config '{path}' is ") and "not a regular file" in result.stderr


def test_a_preset_larger_than_a_megabyte_is_refused_before_reading(tmp_path, capsys):
    preset = tmp_path / "preset.yaml"
    preset.write_text("# padding\n" * 200_000 + "lr: 0.1\n")
    err = one_line_error(capsys, run_tiny_in_process(tmp_path / "out", "--config", str(preset)), tmp_path / "out")
    assert f"--config '{preset}' is larger than 1 MB" in err


def test_a_preset_that_is_not_utf8_names_the_file(tmp_path, capsys):
    preset = tmp_path / "preset.yaml"
    preset.write_bytes(b"\xff\xfe lr: 1\n")
    err = one_line_error(capsys, run_tiny_in_process(tmp_path / "out", "--config", str(preset)), tmp_path / "out")
    assert f"--config '{preset}' is not UTF-8 text" in err and "byte 0xff at offset 0" in err


# --------------------------------------------------------------------------- W&B environment


@pytest.mark.parametrize("flags", [[], ["--wandb-mode", "offline"]])  # wandb itself reads $WANDB_MODE even then
def test_a_bogus_wandb_mode_variable_is_one_line_naming_the_allowed_modes(tmp_path, capsys, monkeypatch, flags):
    monkeypatch.setenv("WANDB_MODE", "bogus")
    code = run_tiny_in_process(tmp_path / "out", *TINY, "--report-to", "wandb", *flags)
    err = one_line_error(capsys, code, tmp_path / "out")
    assert "WANDB_MODE='bogus' is invalid" in err and "online, offline, disabled" in err


def test_a_bogus_wandb_mode_is_ignored_without_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "bogus")
    assert run_tiny_in_process(tmp_path / "out", *TINY, "--max-steps", "1", "--report-to", "none") == 0


@pytest.mark.slow
def test_an_empty_wandb_mode_counts_as_unset_and_wandb_dir_is_where_the_offline_run_goes(tmp_path):
    """Without credentials: offline, as when WANDB_MODE is not set at all (wandb alone refuses ''); the offline run
    in WANDB_DIR, not in the output folder."""
    out, wandb_dir = tmp_path / "out", tmp_path / "scratch" / "wandb-runs"
    env = {
        **subprocess_env(HOME=str(tmp_path), NETRC=str(tmp_path / "no-netrc"), WANDB_DIR=str(wandb_dir)),
        "WANDB_MODE": "",
    }
    result = subprocess.run(
        [sys.executable, str(TINY_RECIPE), *TINY, "--max-steps", "2", "--log-every", "1", "--output-dir", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    check(result)
    assert "no W&B API key found" in result.stdout
    (run_dir,) = (wandb_dir / "wandb").glob("offline-run-*")
    assert [row["_step"] for row in read_offline_run(run_dir)["history"] if "loss" in row] == [1, 2]
    assert not (out / "wandb").exists()


def test_a_wandb_dir_that_cannot_be_a_folder_is_one_line(tmp_path, capsys, monkeypatch):
    """wandb.init would put the run in /tmp/wandb without a word."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "a-file" / "below"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    err = one_line_error(capsys, run_tiny_in_process(tmp_path / "out", *TINY, "--report-to", "wandb"), tmp_path / "out")
    assert f"WANDB_DIR='{tmp_path / 'a-file' / 'below'}' cannot be a folder" in err


# --------------------------------------------------------------------------- DeepSpeed JSON


ZERO2 = json.loads((REPO / "accelerate_configs" / "deepspeed" / "zero2.json").read_text())


def write_deepspeed_json(tmp_path, config) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize(
    "config,message",
    [
        ([ZERO2], "must be a JSON object of setting: value, not a list"),
        ({**ZERO2, "zero_optimization": {"stage": 7}}, "zero_optimization.stage 7 is invalid: must be 0, 1, 2 or 3"),
        (
            {**ZERO2, "zero_optimization": {"stage": "two"}},
            "zero_optimization.stage 'two' is invalid: must be 0, 1, 2 or 3",
        ),
        ({**ZERO2, "zero_optimization": [2]}, "zero_optimization [2] is invalid: must be a JSON object"),
        ({**ZERO2, "bf16": True}, "bf16 True is invalid: must be a JSON object"),
        (
            {**ZERO2, "train_micro_batch_size_per_gpu": "big"},
            "sets train_micro_batch_size_per_gpu='big' but --batch-size gives 128",
        ),
    ],
    ids=["list", "stage-7", "stage-two", "zero-list", "bf16-bool", "batch-word"],
)
def test_a_broken_deepspeed_json_is_one_line_naming_file_key_and_allowed(tmp_path, monkeypatch, config, message):
    path = write_deepspeed_json(tmp_path, config)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", path)
    with pytest.raises(ConfigError) as err:
        deepspeed_plugin(TrainConfig())
    assert (
        str(err.value).startswith(f"DeepSpeed config {path!r}")
        and message in str(err.value)
        and "\n" not in str(err.value)
    )


def test_a_deepspeed_stage_of_auto_is_left_to_accelerate(tmp_path, monkeypatch):
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv(
        "ACCELERATE_DEEPSPEED_CONFIG_FILE",
        write_deepspeed_json(tmp_path, {**ZERO2, "zero_optimization": {"stage": "auto"}}),
    )
    assert deepspeed_plugin(TrainConfig()).zero_stage == 2


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_bad_zero_stage_under_accelerate_launch_is_the_launchers_root_cause(tmp_path):
    """Refused by run_recipe, before DeepSpeed sets up the process group (and builds its CPU ops)."""
    pytest.importorskip("deepspeed")
    path = write_deepspeed_json(tmp_path, {**ZERO2, "zero_optimization": {"stage": 7}})
    launcher_config = tmp_path / "deepspeed.yaml"
    launcher_config.write_text(
        (REPO / "accelerate_configs" / "deepspeed_zero2.yaml")
        .read_text()
        .replace("accelerate_configs/deepspeed/zero2.json", path)
    )
    result = launch(
        TINY_RECIPE,
        [*TINY, "--report-to", "none", "--output-dir", str(tmp_path / "out")],
        launcher="accelerate",
        config=str(launcher_config),
        timeout=120,
    )
    line = f"error: DeepSpeed config {path!r}: zero_optimization.stage 7 is invalid: must be 0, 1, 2 or 3"
    before, root_cause = result.stderr.split("Root Cause")
    assert result.returncode == 1 and line in before and line in root_cause, result.stderr[-3000:]
    assert "ValidationError" not in result.stderr and not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- a stop to be resumed, under torchelastic


def test_a_stop_to_be_resumed_writes_torchelastics_error_file(tmp_path, monkeypatch):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    assert run_tiny_in_process(tmp_path / "out", *TINY, "--max-steps", "5", "--stop-after-steps", "2") == 75
    report = json.loads(error_file.read_text())["message"]
    message = "stopped at step 2 to be resumed (stop_after_steps); continue with --resume auto"
    assert report["message"] == message and report["extraInfo"]["py_callstack"] == message
    assert int(report["extraInfo"]["timestamp"]) <= time.time()


def test_a_finished_run_writes_no_error_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    assert run_tiny_in_process(tmp_path / "out", *TINY, "--max-steps", "2") == 0
    assert not (tmp_path / "error.json").exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_under_torchrun_a_stop_to_be_resumed_is_the_launchers_root_cause(tmp_path):
    result = launch(
        TINY_RECIPE,
        [*TINY, "--max-steps", "5", "--stop-after-steps", "2", "--output-dir", str(tmp_path / "out")],
        launcher="torchrun",
        timeout=120,
    )
    root_cause = result.stderr.split("Root Cause")[-1]
    assert result.returncode == 1 and "exitcode  : 75" in root_cause, result.stderr[-3000:]
    assert "stopped at step 2 to be resumed (stop_after_steps); continue with --resume auto" in root_cause
    assert "To enable traceback" not in root_cause
