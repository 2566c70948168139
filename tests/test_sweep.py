"""acceltrain sweep (issue 47): a hyperparameter search on Optuna whose trials are ordinary run folders, that survives
preemption (SIGTERM mid-trial: exit 75; the same command again resumes that trial from its checkpoint and ends with
exactly N trials), reports evaluations to the study and stops a pruned trial as a finished run, shares one study
between workers through an RDB URL, and refuses bad input in one line before any trial, writing nothing."""

from __future__ import annotations

import csv
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, TINY_RECIPE, launch, read_summary, run_tiny_in_process, subprocess_env

from acceltrain.commands.sweep import main as sweep
from acceltrain.hooks.pruning import SWEEP_ENV, open_storage

SWEEP = [sys.executable, "-m", "acceltrain", "sweep"]
UNBATCHED = [
    *("--num-train", "64", "--num-eval", "16", "--max-steps", "8", "--eval-every", "2"),
    *("--no-progress", "--num-workers", "0", "--report-to", "none"),
]
TINY = ["--batch-size", "8", *UNBATCHED]
SPACE = ["--param", "lr=loguniform:0.02:0.5", "--param", "momentum=choice:0.0,0.9"]


def sweep_argv(study: Path, *extra: str, trials: int = 6, recipe_args: list[str] = TINY) -> list[str]:
    return [*SWEEP, "--study-dir", str(study), "--trials", str(trials), *extra, str(TINY_RECIPE), *recipe_args]


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    """The done-when bar, at 3 trials (docs/sweep.md gives the 6-trial run): a sweep sent SIGTERM while its third trial
    trains (after that trial's first evaluation, read from its output: no clock), then the same command again."""
    study = tmp_path_factory.mktemp("sweep") / "study"
    argv = sweep_argv(study, *SPACE, "--pruner", "none", "--seed", "3", trials=3) + ["--sleep-per-step", "0.1"]
    first = subprocess.Popen(
        argv, cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output, in_third = [], False
    for line in first.stdout:
        output.append(line)
        in_third = in_third or line.startswith("sweep: trial 2:")
        if in_third and line.startswith("step=2 eval_loss"):
            first.send_signal(signal.SIGTERM)
            in_third = False
    first.wait(timeout=300)
    after_first = json.loads((study / "sweep.json").read_text())
    second = subprocess.run(argv, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    return study, argv, first.returncode, "".join(output), after_first, second


def test_a_preempted_sweep_exits_75_and_the_same_command_finishes_it(preempted):
    study, _, first_code, output, after_first, second = preempted
    assert first_code == 75, output[-3000:]
    assert after_first["counts"] == {"complete": 2, "pruned": 0, "failed": 0, "running": 1}, "nothing marked failed"
    assert second.returncode == 0, second.stderr[-3000:]
    assert "sweep: trial 2 (resumed from its checkpoint)" in second.stdout
    result = json.loads((study / "sweep.json").read_text())
    assert result["counts"] == {"complete": 3, "pruned": 0, "failed": 0, "running": 0} and result["finished"]
    folders = sorted(path.name for path in study.glob("trial_*"))
    assert folders == [f"trial_{number:04d}" for number in range(3)]
    assert read_summary(study / "trial_0002")["resumed_from_step"] is not None
    assert all(read_summary(study / name)["resumed_from_step"] is None for name in folders if name != "trial_0002")
    values = {name: read_summary(study / name)["eval_accuracy"] for name in folders}
    assert result["best"]["value"] == max(values.values())
    assert Path(result["best"]["folder"]).name in [
        name for name, value in values.items() if value == max(values.values())
    ]


def test_each_trial_is_a_run_folder_with_its_parameters_and_the_studys_wandb_group(preempted):
    study = preempted[0]
    rows = list(csv.DictReader((study / "trials.csv").open()))
    assert [row["trial"] for row in rows] == [str(n) for n in range(3)]
    seen = set()
    for row in rows:
        config = yaml.safe_load((study / row["folder"] / "train_config.yaml").read_text())
        assert f"{config['lr']:.6g}" == row["lr"] and str(config["momentum"]) == row["momentum"]
        assert config["wandb_group"] == "study"
        assert (study / row["folder"] / "model.safetensors").is_file()
        seen.add((row["lr"], row["momentum"]))
    assert len(seen) == 3, "a resumed sweep never asks the same parameters again"
    assert (study / "history.png").stat().st_size > 0


def test_show_prints_the_table_and_runs_nothing(preempted, capsys):
    study = preempted[0]
    before = {path: path.stat().st_mtime_ns for path in study.rglob("*")}
    assert sweep(["--study-dir", str(study), "--show"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["trial", "state", "eval_accuracy", "lr", "momentum", "folder", "note"]
    assert "3 complete, 0 pruned, 0 failed, 0 running, of 3 trials" in out and "best: trial " in out
    assert {path: path.stat().st_mtime_ns for path in study.rglob("*")} == before


def test_the_same_command_on_a_finished_study_runs_nothing_more(preempted, capsys):
    study, argv, *_ = preempted
    assert sweep(argv[len(SWEEP) :]) == 0
    assert "sweep: trial" not in capsys.readouterr().out
    assert len(list(study.glob("trial_*"))) == 3


def test_a_study_dir_holding_another_study_is_one_line(preempted, capsys):
    study, argv = preempted[0], preempted[1]
    before = sorted(study.rglob("*"))
    other = [arg.replace("lr=loguniform:0.02:0.5", "lr=uniform:0.02:0.5") for arg in argv[len(SWEEP) :]]
    assert sweep(other) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --study-dir {str(study)!r} holds another study: its parameters are"), err
    assert "'lr=uniform:0.02:0.5 momentum=choice:0.0,0.9'" in err and len(err.splitlines()) == 1
    assert sorted(study.rglob("*")) == before


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--param", "lrr=uniform:0.1:1"], "--param lrr=uniform:0.1:1: --lrr (did you mean --lr?) is not a flag"),
        (["--param", "lr=normal:0:1"], "--param lr=normal:0:1: unknown kind 'normal'; SPEC is one of loguniform:"),
        (["--param", "lr=uniform:0.5:0.1"], "--param lr=uniform:0.5:0.1: LOW 0.5 must be below HIGH 0.1"),
        (["--param", "lr=loguniform:0:1"], "--param lr=loguniform:0:1: LOW 0.0 must be > 0 on a log scale"),
        (["--param", "lr=uniform:x:1"], "--param lr=uniform:x:1: LOW 'x' is not a number"),
        (
            ["--param", "warmup-steps=uniform:0:4"],
            "--param warmup-steps=uniform:0:4: --warmup-steps takes integers: use",
        ),
        (["--param", "momentum=uniform:0:1.5"], "--param momentum=uniform:0:1.5: --momentum 1.5 is invalid: must be"),
        (["--param", "optimizer=choice:sgd,adam"], "--param optimizer=choice:sgd,adam: --optimizer 'adam' is invalid"),
        (["--param", "output-dir=choice:a,b"], "--param output-dir=choice:a,b: --output-dir is set by the sweep"),
        (["--param", "lr"], "--param lr: give NAME=SPEC, with SPEC one of loguniform:LOW:HIGH"),
        (["--trials", "0", "--param", "lr=uniform:0.1:1"], "--trials 0: it must be an integer >= 1"),
        (
            ["--sampler", "grid", "--param", "lr=uniform:0.1:1"],
            "--sampler grid needs int or choice parameters: --param lr=uniform:0.1:1",
        ),
        (
            ["--storage", "sqlite:////no/such/folder/study.db", "--param", "lr=uniform:0.1:1"],
            "--storage 'sqlite:////no/such/folder/study.db' cannot be reached: ",
        ),
        (["--launch-config", "nope.yaml", "--param", "lr=uniform:0.1:1"], "--launch-config 'nope.yaml' is not a file"),
    ],
)
def test_bad_input_is_one_line_before_any_trial_and_writes_nothing(tmp_path, capsys, argv, message):
    study = tmp_path / "study"
    trials = [] if "--trials" in argv else ["--trials", "2"]
    code = sweep(["--study-dir", str(study), *trials, *argv, str(TINY_RECIPE), *TINY])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(f"error: {message}") and len(err.splitlines()) == 1, err
    assert not study.exists()


def test_a_study_dir_that_holds_other_files_is_refused_and_left_as_it_was(tmp_path, capsys):
    """A command writes only what it owns: a folder of the user's (a project, a run folder) is no study folder, and a
    sweep there would have written its journal and trial folders among the user's files (and, on bad input later,
    removed what it took for its own)."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    code = sweep(["--study-dir", str(folder), "--trials", "2", "--param", "lr=uniform:0.1:1", str(TINY_RECIPE), *TINY])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: --study-dir {str(folder)!r} holds files that are not a study's (notes.txt)"), err
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            ["--metric", "eval_f1"],
            "error: --metric eval_f1: the task does not log it; it logs eval_loss, eval_accuracy",
        ),
        (  # a recipe flag every trial shares, refused only once the run is built: found by the probe launch
            ["--early-stopping-patience", "4"],
            "error: --early-stopping-patience 4 can never stop this run",
        ),
    ],
)
def test_what_only_a_launch_finds_is_found_before_the_first_trial(tmp_path, capfd, extra, message):
    study = tmp_path / "study"
    metric, recipe_flags = (extra, []) if extra[0] == "--metric" else ([], extra)
    argv = sweep_argv(study, "--param", "lr=uniform:0.1:0.5", *metric, trials=2) + recipe_flags
    assert sweep(argv[len(SWEEP) :]) == 2
    out, err = capfd.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(message), err[-2000:]
    assert "sweep: trial" not in out and not study.exists()


def test_two_workers_share_one_sqlite_study_without_running_a_trial_twice(tmp_path):
    """Two sweeps at once on one SQLite URL and one study folder: 3 trials in all, each run once; the grid's point
    whose batch is larger than the data fails with its one line, recorded, and the sweep goes on."""
    import optuna

    study, url = tmp_path / "study", f"sqlite:///{tmp_path / 'study.db'}"
    grid = ["--sampler", "grid", "--param", "batch_size=choice:8,16,100", "--pruner", "none"]
    argv = sweep_argv(study, "--storage", url, *grid, trials=3, recipe_args=UNBATCHED)
    workers = [
        subprocess.Popen(
            argv, cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outputs = [worker.communicate(timeout=300) for worker in workers]
    assert [worker.returncode for worker in workers] == [0, 0], [err[-2000:] for _, err in outputs]
    started = [int(n) for out, _ in outputs for n in re.findall(r"^sweep: trial (\d+):", out, re.M)]
    assert sorted(started) == [0, 1, 2], "each trial launched once, by one of the workers"
    trials = optuna.load_study(study_name="study", storage=open_storage(url)).trials
    assert sorted(t.params["batch_size"] for t in trials) == ["100", "16", "8"]
    failed = [t for t in trials if t.state.name == "FAIL"]
    assert [t.params["batch_size"] for t in failed] == ["100"]
    assert failed[0].user_attrs["error"].startswith("--batch-size 100 is too large")
    assert json.loads((study / "sweep.json").read_text())["counts"] == {
        "complete": 2,
        "pruned": 0,
        "failed": 1,
        "running": 0,
    }
    assert sorted(p.name for p in study.glob("trial_*")) == sorted(
        f"trial_{t.number:04d}" for t in trials if t.state.name == "COMPLETE"
    )


def pruning_study(tmp_path, values=(0.9, 0.9, 0.9, 0.9)):
    """A study whose five finished trials were at ``values`` at the evaluations of steps 2, 4, 6 and 8: at 0.9, any
    tiny run is below their median."""
    import optuna

    spec = f"journal:{tmp_path / 'study.journal'}"
    study = optuna.create_study(storage=open_storage(spec), study_name="s", direction="maximize")
    for _ in range(5):
        steps = dict(zip((2, 4, 6, 8), values, strict=True))
        study.add_trial(optuna.trial.create_trial(value=values[-1], intermediate_values=steps))
    trial = study.ask()
    env = {"storage": spec, "study": "s", "trial_id": trial._trial_id, "number": trial.number}
    return study, trial, json.dumps({**env, "metric": "eval_accuracy", "pruner": "median"})


def test_a_pruned_trial_finishes_at_that_step_as_a_normal_stop(tmp_path, monkeypatch):
    study, trial, env = pruning_study(tmp_path)
    monkeypatch.setenv(SWEEP_ENV, env)
    out = tmp_path / "run"
    assert run_tiny_in_process(out, *TINY) == 0
    summary = read_summary(out)
    assert summary["stop_reason"] == "pruned" and summary["steps"] == 2
    assert study.trials[-1].intermediate_values == {2: summary["eval_accuracy"]}


def test_a_trial_below_the_median_only_at_its_last_evaluation_completes_and_is_not_said_pruned(
    tmp_path, monkeypatch, capfd
):
    _, _, env = pruning_study(tmp_path, values=(0.0, 0.0, 0.0, 1.0))
    monkeypatch.setenv(SWEEP_ENV, env)
    out = tmp_path / "run"
    assert run_tiny_in_process(out, *TINY) == 0
    assert read_summary(out)["stop_reason"] is None and read_summary(out)["steps"] == 8
    assert "pruned" not in capfd.readouterr().out  # it said "pruned by the sweep at step 8" of a complete trial


@pytest.mark.multiprocess
def test_the_main_process_decides_and_every_process_stops_at_that_step(tmp_path):
    _, _, env = pruning_study(tmp_path)
    out = tmp_path / "run"
    result = launch(
        TINY_RECIPE,
        ["--output-dir", str(out), "--batch-size", "4", *UNBATCHED],
        processes=2,
        launcher="accelerate",
        **{SWEEP_ENV: env},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_summary(out)["stop_reason"] == "pruned" and read_summary(out)["steps"] == 2
    assert [json.loads((out / f"rank{rank}.json").read_text())["steps"] for rank in (0, 1)] == [2, 2]
