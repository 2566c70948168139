"""Hostile inputs (issue 31, round 4): streams sharded unevenly across processes,
workers whose launcher died, a stream that shrank, hooks that edit the run's config, option groups that
clash, and a refusal that must come before DeepSpeed starts. (Edited checkpoints: test_checkpoint_tampering;
changed text: test_causal_lm.)"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import subprocess
import sys
import time

import pytest
from conftest import REPO, TINY_RECIPE, _free_port, check, launch, read_summary, run_tiny_in_process, subprocess_env

from acceltrain import ConfigError, Hook, Options, TrainConfig, option, parse_config
from acceltrain.checkpoint.files import checkpoint_dir
from acceltrain.runtime.preemption import EXIT_PREEMPTED

# 96 samples a pass on the first process, 88 on the second: at batch 8 on 2 processes with 2 loader workers each,
# 6 and 4 batches a pass (each worker drops its own partial batch)
UNEVEN = [
    "--stream",
    "torch",
    "--batch-size",
    "8",
    "--max-steps",
    "14",
    "--lr",
    "0.05",
    "--no-progress",
    "--num-workers",
    "2",
    "--report-to",
    "none",
    "--log-every",
    "1",
]


@pytest.fixture(scope="module")
def uneven_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("uneven") / "run"
    return out, check(
        launch(
            TINY_RECIPE,
            [*UNEVEN, "--stream-drop", "0,8", "--save-every-steps", "4", "--output-dir", str(out)],
            processes=2,
            launcher="torchrun",
            timeout=600,
        )
    )


@pytest.mark.slow
@pytest.mark.multiprocess
def test_uneven_streams_end_each_pass_together_as_the_shorter_one_does(tmp_path, uneven_run):
    """Before: fit() hung for good in a collective when one process's stream ended first."""
    out, result = uneven_run
    even = tmp_path / "even"
    check(
        launch(
            TINY_RECIPE, [*UNEVEN, "--stream-drop", "8,8", "--output-dir", str(even)], processes=2, launcher="torchrun"
        )
    )
    assert (out / "model.safetensors").read_bytes() == (even / "model.safetensors").read_bytes()
    assert read_summary(out)["epochs"] == read_summary(even)["epochs"] == 3.0
    assert (
        "process 0: pass 0 of the training stream ended on another process after 4 batches; the rest of this process's "
        "pass is left out"
    ) in result.stderr + result.stdout


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_uneven_stream_resumed_where_a_pass_ended_continues_byte_identically(tmp_path, uneven_run):
    """The longer stream's loader position is recorded as its pass's end: the resume starts the next pass. The
    checkpoint is the uninterrupted run's own, of step 4, where the shorter stream's first pass ended."""
    out, full = tmp_path / "run", uneven_run[0]
    step_4 = checkpoint_dir(full, 4)
    args = [*UNEVEN, "--stream-drop", "0,8", "--output-dir", str(out), "--resume", str(step_4)]
    check(launch(TINY_RECIPE, args, processes=2, launcher="torchrun"))
    assert (out / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_workers_do_not_outlive_a_launcher_killed_outright(tmp_path):
    """Before: torchrun SIGKILLed (a job step's or a test's timeout) left its workers running, and a worker waiting
    in a collective never ended."""
    psutil = pytest.importorskip("psutil")
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(_free_port()),
        str(TINY_RECIPE),
        "--batch-size",
        "8",
        "--max-steps",
        "100000",
        "--sleep-per-step",
        "0.2",
        "--num-workers",
        "0",
        "--no-progress",
        "--report-to",
        "none",
        "--log-every",
        "1",
        "--output-dir",
        str(out),
    ]
    launcher = subprocess.Popen(
        command, cwd=REPO, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 300  # a hang guard: training starts in seconds
        while not ((out / "metrics.jsonl").is_file() and '"loss"' in (out / "metrics.jsonl").read_text()):
            assert launcher.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.2)
        workers = psutil.Process(launcher.pid).children(recursive=True)
        assert len(workers) >= 2
    finally:
        launcher.kill()
        launcher.wait()
    gone, alive = psutil.wait_procs(workers, timeout=120)
    for worker in alive:
        with contextlib.suppress(psutil.NoSuchProcess):  # it may end between the wait and the kill
            worker.kill()
    assert not alive, f"{len(alive)} worker(s) outlived their launcher"


def test_a_stream_that_shrank_before_the_resume_is_one_line(tmp_path, capsys):
    """Before: "resumed at step 2", then RuntimeError: generator raised StopIteration. (This stream has no
    fingerprint; the causal-LM recipe's text has one, and a shrunk text is refused before loading.)"""
    out = tmp_path / "run"
    args = [
        "--stream",
        "torch",
        "--batch-size",
        "8",
        "--grad-accum",
        "5",
        "--max-steps",
        "12",
        "--no-progress",
        "--num-workers",
        "0",
        "--report-to",
        "none",
    ]
    assert run_tiny_in_process(out, *args, "--stop-after-steps", "2") == EXIT_PREEMPTED
    assert run_tiny_in_process(out, *args, "--resume", "auto", "--num-train", "48", "--allow-config-change") == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: the training stream ended before the checkpoint's place in it (batch 10 of pass 0 on each process): "
        "it holds less data than when the checkpoint was written; restore it, or start a new --output-dir"
    ), err


class SetsTheLearningRate(Hook):
    def on_step_end(self, run):
        run.cfg.lr = 5.0


def test_a_hook_cannot_change_the_runs_config(tmp_path):
    """Before: run.cfg.lr = 5.0 trained on with 0.1 while train_config.yaml and the checkpoint recorded 5.0."""
    with pytest.raises(
        dataclasses.FrozenInstanceError, match="cannot set 'lr': the run's config is read-only once training starts"
    ):
        run_tiny_in_process(
            tmp_path / "run",
            "--batch-size",
            "8",
            "--max-steps",
            "2",
            "--no-progress",
            "--num-workers",
            "0",
            "--report-to",
            "none",
            hooks=[SetsTheLearningRate()],
        )
    cfg = TrainConfig()
    cfg.lr = 0.5  # before fit(), a config is the user's to change
    assert dataclasses.replace(cfg.read_only(), lr=0.2).lr == 0.2


@dataclasses.dataclass
class ClashingOptions(Options):
    max_steps: int = option(999, "a hook's own step count that shadows the loop's")


@dataclasses.dataclass
class ClashingConfig(ClashingOptions, TrainConfig):
    pass


def test_an_option_group_that_redeclares_another_groups_flag_is_refused():
    """Before: the hook's max_steps silently took over --max-steps, its help text and its default of 999."""
    message = (
        "option groups LoopOptions and ClashingOptions both declare max_steps (--max-steps): rename the field of "
        "ClashingOptions"
    )
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(ClashingConfig, [])
    with pytest.raises(ConfigError, match=re.escape(message)):
        ClashingConfig().validate()
    from acceltrain.recipes.causal_lm import CausalLMConfig

    assert parse_config(CausalLMConfig, ["--text-files", "x"]).batch_size == 16, (
        "a recipe may change its own bases' defaults"
    )


@pytest.mark.parametrize(
    ("settings", "line"),
    [
        ({"optimizer": "muon"}, "--optimizer muon needs every weight matrix whole on each process, and DeepSpeed"),
        ({"async_checkpoint": True}, "--async-checkpoint works under DDP and FSDP; DeepSpeed writes its checkpoints"),
    ],
)
def test_what_deepspeed_cannot_run_is_refused_before_the_process_group_starts(monkeypatch, settings, line):
    """Before: the refusal came after DeepSpeed's start-up (muon: 102 s on a CPU; --async-checkpoint: at the
    checkpointer's set-up, 14 s into a test launch)."""
    import accelerate

    from acceltrain.runtime.distributed import init_process_state

    def started(*args, **kwargs):
        raise AssertionError("the process group started before the refusal")

    monkeypatch.setattr(accelerate, "PartialState", started)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ConfigError, match=line):
        init_process_state(TrainConfig(**settings))
