"""The torchft engine and `acceltrain ft-launch` (issue 45): replica groups that heal from a live peer instead of
restarting the job. The logic without a launch first; then two launches of the tiny recipe as 2 groups of one
process: one group SIGKILLed mid-run and healed, and every group killed, then `--resume auto`."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY_RECIPE, read_summary, subprocess_env

from acceltrain import TrainConfig
from acceltrain.commands import ft_launch
from acceltrain.config.options import ConfigError
from acceltrain.data.loaders import EpochSampler

pytest.importorskip("torchft", reason="the ft extra: pip install -e '.[ft]'")

from acceltrain.engines.torchft import TorchFT  # noqa: E402  (imports torchft lazily, but only matters with it)

FT_LAUNCH = [sys.executable, "-m", "acceltrain", "ft-launch"]
# 96 optimizer steps (each group reads half of the samples) of 0.1 s or more
TINY = (
    "--num-train 3072 --batch-size 16 --epochs 1 --lr 0.05 --batchnorm --no-progress --log-every 16 --report-to none "
    "--num-workers 0 --sleep-per-step 0.1"
).split()
STEPS = 96


# ---- without a launch


def test_each_replica_group_reads_its_own_equal_shard_of_every_epoch():
    shards = [EpochSampler(103, seed=5, shard=(index, 3)) for index in range(3)]
    for epoch in (0, 1):
        for sampler in shards:
            sampler.set_epoch(epoch)
        seen = [[index for _, index in sampler] for sampler in shards]
        assert [len(indices) for indices in seen] == [34, 34, 34] == [len(sampler) for sampler in shards]
        flat = [index for indices in seen for index in indices]
        assert len(set(flat)) == len(flat)  # disjoint
        if epoch == 0:
            first = seen
    assert seen != first  # reshuffled across the groups every epoch
    assert [index for _, index in EpochSampler(10, seed=5)] == EpochSampler(10, seed=5).order(0)  # one group: all


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--replica-groups", "0", "r.py"], "--replica-groups is 0"),
        (["r.py"], "--replica-groups is required"),
        (["--replica-groups", "2", "--nproc-per-group", "2", "r.py"], "--nproc-per-group 2"),
        (["--replica-groups", "2", "--min-replicas", "3", "r.py"], "--min-replicas 3 is more than the 2"),
        (["--replica-groups", "2", "--max-restarts", "-1", "r.py"], "--max-restarts -1"),
        (["--replica-groups", "2"], "no recipe given"),
        (["--replica-groups", "2", "--max-restart", "1", "r.py"], "unrecognized"),
    ],
)
def test_ft_launch_refuses_bad_input_in_one_line_before_anything_starts(argv, says, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    try:
        code = ft_launch.main(argv)
    except SystemExit as stop:  # argparse's own refusal
        code = stop.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1 and says in err[-1], err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_ft_launch_refuses_another_engine_asked_in_the_environment_and_a_port_in_use(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert ft_launch.main(["--replica-groups", "2", "r.py"]) == 2
    assert "asks for DEEPSPEED" in capsys.readouterr().err
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    import socket

    with socket.socket(socket.AF_INET6) as taken:
        taken.bind(("::", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["--replica-groups", "2", "--lighthouse-port", str(port), "r.py", "--output-dir", "out"]
        assert ft_launch.main(argv) == 2
    assert f"--lighthouse-port {port}: the Lighthouse cannot listen there" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_missing_torchft_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)
    with pytest.raises(ConfigError, match=r"pip install 'acceltrain\[ft\]'"):
        TorchFT.process_state_ready(None)


@pytest.mark.parametrize(
    ("settings", "says"), [({"async_checkpoint": True}, "--async-checkpoint"), ({"data_on_device": True}, "device")]
)
def test_the_engine_refuses_what_replica_groups_cannot_run(settings, says):
    with pytest.raises(ConfigError, match=says):
        TorchFT.refuse(TrainConfig(**settings))


def test_a_restarted_group_resumes_unless_told_where(tmp_path):
    assert ft_launch._restart_args(["--lr", "1"]) == ["--lr", "1", "--resume", "auto"]
    assert ft_launch._restart_args(["--resume", "auto"]) == ["--resume", "auto"]
    args, folder = ft_launch._with_output_dir("recipes/x.py", ["--lr", "1"])
    assert args[:2] == ["--lr", "1"] and args[2] == "--output-dir" and folder == Path(args[3])
    assert folder.parent == Path("runs") and folder.name.startswith("x-")  # one name for every group
    assert ft_launch._with_output_dir("m.recipe", ["--output-dir=o"]) == (["--output-dir=o"], Path("o"))


def test_the_launch_s_status_is_the_bad_input_that_stopped_the_groups_whichever_ended_first():
    """Replica 1 refused first and the launch's SIGTERM ended replica 0: the status was 143, not 2."""
    assert ft_launch._status([-15, 2]) == ft_launch._status([2, -15]) == 2
    assert ft_launch._status([75, 75]) == 75 and ft_launch._status([-9, 1]) == 137 and ft_launch._status([0, 0]) == 0


def test_ft_launch_writes_nothing_into_a_folder_its_groups_could_not_claim(tmp_path, capsys, monkeypatch):
    """Its events and logs were written into another live run's folder (or one holding the user's files, or a
    finished run) before the groups' claim refused it."""
    monkeypatch.chdir(tmp_path)
    live = tmp_path / "live"
    live.mkdir()
    (live / ".lock").write_text("")
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER, str(live / ".lock")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert ft_launch.main(["--replica-groups", "2", "r.py", "--output-dir", str(live)]) == 2
        assert "is in use by another run" in capsys.readouterr().err
        assert sorted(p.name for p in live.iterdir()) == [".lock"]
    finally:
        holder.kill()
    for name in ("model.safetensors", "summary.json"):  # the user's own file; a finished run
        folder = tmp_path / name.split(".")[0]
        folder.mkdir()
        (folder / name).write_text("{}")
        if name == "summary.json":
            (folder / ".lock").write_text("")
        before = sorted(p.name for p in folder.iterdir())
        assert ft_launch.main(["--replica-groups", "2", "r.py", "--output-dir", str(folder)]) == 2
        assert f"--output-dir {str(folder)!r}" in capsys.readouterr().err
        assert sorted(p.name for p in folder.iterdir()) == before


def test_a_launch_its_groups_refuse_leaves_the_folder_as_it_found_it(tmp_path, capsys):
    """The groups refused a bad recipe flag before training: the launch's own events and logs stayed behind, in a
    folder it had made (or beside the user's files in one it had not)."""
    made = tmp_path / "made"
    bad = [str(TINY_RECIPE), "--lr", "-1", "--report-to", "none", "--no-progress"]
    assert ft_launch.main(["--replica-groups", "2", *bad, "--output-dir", str(made)]) == 2
    assert not made.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("the user's")
    assert ft_launch.main(["--replica-groups", "1", *bad, "--output-dir", str(kept)]) == 2
    assert [p.name for p in kept.iterdir()] == ["notes.txt"]
    finished = tmp_path / "finished"  # --overwrite had moved the finished run aside for good
    finished.mkdir()
    for name in ("summary.json", ".lock"):
        (finished / name).write_text("{}")
    assert ft_launch.main(["--replica-groups", "1", *bad, "--overwrite", "--output-dir", str(finished)]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["finished", "kept"]
    assert sorted(p.name for p in finished.iterdir()) == [".lock", "summary.json"]


LOCK_HOLDER = """
import fcntl, os, sys, time
descriptor = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(descriptor, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(120)
"""


# ---- launched


def _events(folder: Path) -> list[dict]:
    path = folder / "ft_events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _start(out: Path, launcher: list[str], *recipe_args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*FT_LAUNCH, *launcher, str(TINY_RECIPE), *TINY, *recipe_args, "--output-dir", str(out)],
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for(launch: subprocess.Popen, folder: Path, ready, what: str, timeout: float = 120) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = _events(folder)
        if ready(folder, events):
            return events
        if launch.poll() is not None:
            break
        time.sleep(0.1)
    launch.kill()
    pytest.fail(f"no {what}: {_events(folder)}\n{launch.communicate()[0][-3000:]}")


def _first_quorums(events: list[dict]) -> dict[int, int]:
    """Each replica's participants in the first quorum of its latest start."""
    first = {}
    for event in events:
        if event["event"] == "started":
            first.pop(event["replica"], None)
        elif event["event"] == "quorum":
            first.setdefault(event["replica"], event["participants"])
    return first


def _pid(events: list[dict], replica: int) -> int:
    return [e for e in events if e["event"] == "started" and e["replica"] == replica][-1]["pid"]


def _training_together(folder: Path, events: list[dict]) -> bool:
    """Both groups in the quorum, and a training-log row past step 16 (written by replica 0)."""
    metrics = folder / "metrics.jsonl"
    logged = metrics.read_text().splitlines() if metrics.exists() else []
    steps = [json.loads(line)["step"] for line in logged if line.endswith("}")]
    together = any(e["event"] == "quorum" and e["participants"] == 2 for e in events)
    return together and any(step >= 16 for step in steps)


def test_a_killed_group_comes_back_and_heals_from_its_peer_while_the_survivor_goes_on(tmp_path):
    """The issue's bar `ft-heals-without-restart`, on the tiny recipe."""
    out = tmp_path / "run"
    launch = _start(out, ["--replica-groups", "2", "--heartbeat-timeout", "2"], "--wait-for-restarted-peer")
    events = _wait_for(launch, out, _training_together, "step 16 with 2 groups")
    victim = _pid(events, 1)
    os.kill(victim, signal.SIGKILL)
    killed = time.time()
    output, _ = launch.communicate(timeout=240)
    assert launch.returncode == 0, output[-3000:]
    events = _events(out)
    after = [e for e in events if e["time"] >= killed]
    assert [e["replica"] for e in events if e["event"] == "started"].count(0) == 1  # the survivor never restarted
    assert any(e["event"] == "quorum" and e["replica"] == 0 and e["participants"] == 1 for e in after)
    healed = [e for e in after if e["event"] == "healed"]
    assert [(e["replica"], e["from_replica"]) for e in healed] == [(1, 0)], events
    assert healed[0]["seconds"] < 10
    finished = {e["replica"]: e for e in events if e["event"] == "finished"}
    assert finished[0]["step"] == finished[1]["step"] == STEPS
    assert finished[0]["weights_sha256"] == finished[1]["weights_sha256"]
    summary = read_summary(out)
    assert summary["steps"] == STEPS and summary["distributed_type"] == "NO"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {row.get("replica_groups") for row in rows if "loss" in row} <= {1, 2}
    assert sorted(p.name for p in (out / "ft_logs").iterdir()) == ["replica_1.log"]  # replica 0's output is ours


def test_every_group_killed_then_resume_auto_continues_from_the_last_checkpoint(tmp_path):
    out = tmp_path / "run"
    args = ["--replica-groups", "2", "--max-restarts", "0", "--heartbeat-timeout", "2"]
    launch = _start(out, args, "--save-every-steps", "16")
    saved = out / "checkpoints" / "step_00000032"

    def checkpointed(folder: Path, events: list[dict]) -> bool:
        return _training_together(folder, events) and saved.is_dir()

    events = _wait_for(launch, out, checkpointed, "checkpoint of step 32")
    # both groups in the first quorum: a group that reported ready before its Manager heartbeated was left out of it,
    # and the other took its first steps alone (a resume then missed the uninterrupted run's bytes)
    assert _first_quorums(events) == {0: 2, 1: 2}, events
    for replica in (0, 1):
        os.kill(_pid(events, replica), signal.SIGKILL)
    output, _ = launch.communicate(timeout=120)
    assert launch.returncode != 0, output[-2000:]
    assert not (out / "summary.json").exists()
    newest = max(int(path.name.split("_")[1]) for path in (out / "checkpoints").glob("step_*"))
    # under one process the checkpoint's 2 groups x 16 samples a step are another layout: refused in one line, not
    # resumed on half the samples per step and twice the steps per epoch
    alone = tmp_path / "alone"
    shutil.copytree(out, alone)
    one = subprocess.run(
        [sys.executable, str(TINY_RECIPE), *TINY, "--save-every-steps", "16", "--resume", "auto"]
        + ["--output-dir", str(alone)],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 2, one.stdout[-2000:]
    assert "resume with 32 samples per optimizer step (here: --grad-accum 2)" in one.stderr.splitlines()[-1]
    again = _start(out, args, "--save-every-steps", "16", "--resume", "auto")
    output, _ = again.communicate(timeout=240)
    assert again.returncode == 0, output[-3000:]
    summary = read_summary(out)
    assert summary["resumed_from_step"] == newest and summary["steps"] == STEPS
    assert _first_quorums(_events(out)) == {0: 2, 1: 2}
    finished = [e for e in _events(out) if e["event"] == "finished"]
    assert len(finished) == 2 and finished[0]["weights_sha256"] == finished[1]["weights_sha256"]
