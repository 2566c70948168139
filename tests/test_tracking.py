"""W&B (offline, read back from the .wandb file with wandb's own protobuf records) and TensorBoard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from acceltrain.tracking import read_offline_run
from conftest import TINY_RECIPE, check, launch, read_events, read_summary

RUN = ["--batch-size", "8", "--log-every", "1", "--eval-every", "3", "--no-progress", "--num-workers", "0"]


def offline_runs(output_dir: Path) -> list[dict]:
    return [read_offline_run(d) for d in sorted((output_dir / "wandb").glob("offline-run-*"))]


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("wandb") / "run"
    result = check(launch(TINY_RECIPE, [*RUN, "--max-steps", "6", "--output-dir", str(out), "--run-name", "tiny-offline",
                                        "--wandb-tags", "a,b", "--log-model"], WANDB_MODE="offline"))
    return out, result


def test_offline_run_records_config_steps_eval_and_summary(offline_run):
    out, _ = offline_run
    (run,) = offline_runs(out)
    assert run["name"] == "tiny-offline"
    assert run["config"]["batch_size"] == 8 and run["config"]["runtime.num_processes"] == 1
    train_rows = [row for row in run["history"] if "loss" in row]
    assert [row["_step"] for row in train_rows] == [1, 2, 3, 4, 5, 6]
    events = {e["step"]: e for e in read_events(out) if "loss" in e}
    assert all(row["loss"] == pytest.approx(events[row["_step"]]["loss"]) and "lr" in row for row in train_rows)
    assert [row["_step"] for row in run["history"] if "eval_accuracy" in row] == [3, 6]
    summary = read_summary(out)
    for key in ("steps", "samples_seen", "eval_accuracy", "train_loss", "samples_per_second"):
        assert run["summary"][key] == pytest.approx(summary[key])
    assert run["artifacts"] == [f"model-{run['id']}"]


def test_two_processes_make_one_wandb_run(tmp_path):
    out = tmp_path / "run"
    check(launch(TINY_RECIPE, [*RUN, "--max-steps", "3", "--output-dir", str(out)], processes=2, launcher="accelerate",
                 WANDB_MODE="offline"))
    assert len(offline_runs(out)) == 1


def test_resume_continues_the_same_wandb_run_with_increasing_steps(tmp_path):
    out = tmp_path / "run"
    args = [*RUN, "--max-steps", "8", "--output-dir", str(out)]
    stopped = launch(TINY_RECIPE, [*args, "--stop-after-steps", "5"], WANDB_MODE="offline")
    assert stopped.returncode == 75, stopped.stderr[-2000:]
    check(launch(TINY_RECIPE, [*args, "--resume", "auto"], WANDB_MODE="offline"))
    first, second = offline_runs(out)
    assert first["id"] == second["id"]
    steps = [row["_step"] for run in (first, second) for row in run["history"] if "loss" in row]
    assert steps == list(range(1, 9)), "no step twice, none missing, always increasing"
    state = json.loads(next((out / "checkpoints").glob("step_*/trainer_state.json")).read_text())
    assert state["tracker_run_id"] == first["id"]


def test_without_api_key_wandb_goes_offline_and_says_how_to_sync(tmp_path):
    out = tmp_path / "run"
    result = launch(TINY_RECIPE, [*RUN, "--max-steps", "2", "--output-dir", str(out)],
                    WANDB_MODE="", HOME=str(tmp_path), NETRC=str(tmp_path / "no-netrc"))
    check(result)
    assert "no W&B API key found" in result.stdout and "wandb sync " in result.stdout
    assert len(offline_runs(out)) == 1


def test_api_key_is_never_written_or_printed(tmp_path):
    secret = "acceltrain-test-secret-0123456789abcdef01234567"
    out = tmp_path / "run"
    result = check(launch(TINY_RECIPE, [*RUN, "--max-steps", "3", "--output-dir", str(out), "--save-every-steps", "2"],
                          WANDB_MODE="offline", WANDB_API_KEY=secret))
    assert secret not in result.stdout + result.stderr
    for file in out.rglob("*"):
        if file.is_file():
            assert secret.encode() not in file.read_bytes(), file


def test_tensorboard_writes_the_same_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    check(launch(TINY_RECIPE, [*RUN, "--max-steps", "4", "--output-dir", str(out), "--report-to", "tensorboard"]))
    accumulators = [EventAccumulator(str(f.parent)).Reload() for f in (out / "logs").rglob("events.out.tfevents.*")]
    (scalars,) = [a for a in accumulators if "loss" in a.Tags()["scalars"]]
    logged = {e.step: e.value for e in scalars.Scalars("loss")}
    expected = {e["step"]: e["loss"] for e in read_events(out) if "loss" in e}
    assert logged == pytest.approx(expected)
    assert not (out / "wandb").exists()
