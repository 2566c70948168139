"""recipes/slurm/train.sbatch on a real single-node SLURM (started by `.ci/slurm-up`): a job that is
signalled (scancel, the time limit's --signal) or requeued (scontrol requeue) saves, is requeued, resumes
and ends byte-identical to an uninterrupted run, in the recipe's own --output-dir where one is given; a job
that fails for good (a bad flag, a missing recipe) fails once, without a requeue. Skipped, with the reason,
where no SLURM answers."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY_RECIPE, check, launch, subprocess_env

pytestmark = pytest.mark.slurm

# 256 optimizer steps; 0.1 s of sleep after each (the maths unchanged) makes a ~30 s run to signal.
ARGS = [
    "--num-train",
    "8192",
    "--batch-size",
    "16",
    "--grad-accum",
    "2",
    "--epochs",
    "1",
    "--lr",
    "0.05",
    "--batchnorm",
    "--no-progress",
    "--log-every",
    "10",
    "--num-workers",
    "0",
    "--report-to",
    "none",
]
SLOW = ["--sleep-per-step", "0.1"]
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")


def _slurm_missing() -> str | None:
    if shutil.which("sbatch") is None:
        return "SLURM is not installed here (bash .ci/slurm-up installs and starts a single-node one, as root)"
    try:
        result = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 15 s: no SLURM controller running (bash .ci/slurm-up)"
    if result.returncode != 0 or not re.search(r"idle|mix|alloc", result.stdout):
        return f"no usable SLURM node: {(result.stderr or result.stdout).strip()[:200] or 'none'} (bash .ci/slurm-up)"
    return None


@pytest.fixture(scope="module")
def slurm():
    reason = _slurm_missing()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, slurm):
    """The uninterrupted run, launched as the sbatch script launches it (accelerate launch, multi_node.yaml)."""
    out = tmp_path_factory.mktemp("slurm-reference") / "run"
    check(
        launch(
            TINY_RECIPE,
            [*ARGS, "--output-dir", str(out)],
            launcher="accelerate",
            config="multi_node.yaml",
            launcher_args=("--num_machines", "1", "--machine_rank", "0", "--main_process_ip", "127.0.0.1"),
        )
    )
    return out


def _env(output_dir: Path) -> dict:
    env = subprocess_env(PROCESSES_PER_NODE="1", OUTPUT_DIR=str(output_dir))
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # `accelerate` of this environment inside the job
    return env


def unused_output_dir(output_dir: Path) -> Path:
    """$OUTPUT_DIR of a job given its folder by the recipe's own --output-dir: nothing may be written there."""
    return output_dir.parent / "unused"


def submit(
    output_dir: Path, *sbatch_args: str, recipe: Path = TINY_RECIPE, recipe_args=SLOW, own_output_dir: str = ""
) -> str:
    """own_output_dir "X" or "=X": the folder goes to the recipe as `--output-dir X` or `--output-dir=X`, and
    $OUTPUT_DIR, which that flag overrides, to unused_output_dir."""
    log = output_dir.parent / "job.log"
    if own_output_dir:
        own = [f"--output-dir={output_dir}"] if own_output_dir == "=X" else ["--output-dir", str(output_dir)]
        recipe_args = [*recipe_args, *own]
    command = [
        "sbatch",
        "--parsable",
        "--nodes=1",
        "--ntasks-per-node=1",
        "--cpus-per-task=1",
        "--gpus-per-node=0",
        f"--job-name=acceltrain-test-{output_dir.parent.name}",
        f"--output={log}",
        "--open-mode=append",
        f"--chdir={REPO}",
        *sbatch_args,
        str(REPO / "recipes" / "slurm" / "train.sbatch"),
        str(recipe),
        *ARGS,
        *recipe_args,
    ]
    env = _env(unused_output_dir(output_dir) if own_output_dir else output_dir)
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0]


def job(job_id: str) -> dict:
    text = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=15).stdout
    return dict(re.findall(r"(\w+)=(\S*)", text))


def wait_for(predicate, what: str, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def logged_steps(output_dir: Path) -> int:
    metrics = output_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def finish_after_requeue(job_id: str, output_dir: Path) -> str:
    """Wait for the requeue and for the requeued job to complete; returns the job's log. (A requeued job
    starts again after the credential lifetime: 120 s by default, 10 s in .ci/slurm-up's cluster.)

    Once requeued, the job gets 10 minutes: a 2-minute limit would signal every attempt again 40-70 s into
    it, and on a slow machine (start-up of ~25 s an attempt) the run then needs one attempt per ~40 steps.
    A finished run is not requeued again: the job ends COMPLETED after exactly one restart."""
    wait_for(lambda: job(job_id).get("Restarts", "0") != "0", "the requeue", 120)
    lifted = subprocess.run(
        ["scontrol", "update", f"JobId={job_id}", "TimeLimit=10"], capture_output=True, text=True, timeout=15
    )
    if lifted.returncode != 0:  # only a job that has already ended may refuse it
        assert job(job_id).get("JobState") in ENDED, f"scontrol update TimeLimit=10: {lifted.stderr.strip()}"
    info = wait_for(lambda: ended_or_requeued(job_id, more_than=1), "the requeued job to end", 300)
    log = (output_dir.parent / "job.log").read_text()
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "1"), log[-4000:]
    return log


def ended_or_requeued(job_id: str, more_than: int = 0) -> dict | None:
    """The job's fields once it has ended or been requeued more than ``more_than`` times, else None."""
    info = job(job_id)
    return info if info.get("JobState") in ENDED or int(info.get("Restarts", "0")) > more_than else None


# Jobs that fail for good, at once (no signal): recipe, recipe flags.
FAILING = {
    "bad_flag": (TINY_RECIPE, ["--no-such-flag"]),
    "missing_recipe": (REPO / "recipes" / "no_such_recipe.py", []),
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, slurm):
    """All jobs at once (they mostly sleep), each of the four to resume signalled once it trains (the time
    limit's signal too, by cutting the limit then): the module takes as long as its slowest job, not the sum.
    Two of them take their folder from the recipe's own --output-dir (both spellings). Name -> (job id, output
    folder)."""
    cases = {
        "scancel": (["--time=10"], SLOW, lambda job_id: ["scancel", "--signal=TERM", job_id]),
        "time_limit": (
            ["--time=10", "--signal=TERM@80"],
            ["--sleep-per-step", "0.3"],
            lambda job_id: ["scontrol", "update", f"JobId={job_id}", "TimeLimit=2"],
        ),
        "requeue": (["--time=10"], SLOW, lambda job_id: ["scontrol", "requeue", job_id]),
        "scancel_full": (
            ["--time=10"],
            [*SLOW, "--save-every-steps", "50"],
            lambda job_id: ["scancel", "--signal=TERM", "--full", job_id],
        ),
    }
    submitted = {}
    try:
        yield _submit_and_signal(cases, submitted, tmp_path_factory)
    finally:  # also when a job never started: nothing is left in the queue
        for job_id, _ in submitted.values():
            wait_for(lambda job_id=job_id: cancelled(job_id), f"job {job_id} to be cancelled", 60)


def cancelled(job_id: str) -> bool:
    """scancel, again until the job has ended: SLURM refuses it while the job is being requeued."""
    subprocess.run(["scancel", job_id], capture_output=True, timeout=15)
    return job(job_id).get("JobState", "CANCELLED") in ENDED  # none: already purged


def _submit_and_signal(cases: dict, submitted: dict, tmp_path_factory) -> dict:
    for name, (recipe, recipe_args) in FAILING.items():
        out = tmp_path_factory.mktemp(f"slurm-{name}") / "run"
        submitted[name] = (submit(out, recipe=recipe, recipe_args=recipe_args), out)
    own_output_dir = {"requeue": "=X", "scancel": "X"}
    for name, (sbatch_args, recipe_args, _) in cases.items():
        out = tmp_path_factory.mktemp(f"slurm-{name}") / "run"
        job_id = submit(out, *sbatch_args, recipe_args=recipe_args, own_output_dir=own_output_dir.get(name, ""))
        submitted[name] = (job_id, out)

    def ready(name: str) -> bool:
        out = submitted[name][1]
        if name == "scancel_full":
            return any((out / "checkpoints").glob("step_*/COMPLETE"))
        return logged_steps(out) >= 3

    pending = set(cases)
    deadline = time.monotonic() + 180
    while pending:  # signal each job as soon as it trains, whatever the order they start in
        for name in sorted(pending):
            if ready(name):
                subprocess.run(cases[name][2](submitted[name][0]), check=True, timeout=15)
                pending.discard(name)
        assert time.monotonic() < deadline, f"jobs {sorted(pending)} did not start training"
        time.sleep(0.1)
    return submitted


def _assert_resumed_identically(jobs, name: str, reference: Path, saved: bool = True) -> None:
    job_id, out = jobs[name]
    log = finish_after_requeue(job_id, out)
    assert "already in use" not in log, "jobs sharing a node took the same rendezvous port"
    if saved:
        assert re.search(r"stopped at step \d+ \(SIGTERM\); checkpoint saved", log), log[-3000:]
    assert "resumed from" in log, log[-3000:]
    assert (out / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()
    assert not unused_output_dir(out).exists(), "the recipe's own --output-dir was not the only folder written"


def test_the_time_limit_signal_checkpoints_requeues_and_resumes_identically(jobs, reference):
    """--signal=TERM@80, and the time limit cut to 2 minutes once the job trains: SLURM's SIGTERM comes within
    about a minute (it checks its timers about once a minute and may signal up to 60 s early), into a ~100 s run (0.3 s
    a step). A job submitted with --time=2 was once signalled 23 s after its start, and on a loaded machine
    before the recipe had started (the job requeued and started over: nothing left to check)."""
    _assert_resumed_identically(jobs, "time_limit", reference)


def test_scancel_sigterm_checkpoints_requeues_and_resumes_identically(jobs, reference):
    """`scancel --signal=TERM`: what preemption sends the job step. The folder is the recipe's own
    `--output-dir X`, not $OUTPUT_DIR."""
    _assert_resumed_identically(jobs, "scancel", reference)


def test_scontrol_requeue_of_a_running_job_resumes_identically(jobs, reference):
    """The folder is the recipe's own `--output-dir=X`, not $OUTPUT_DIR: the finished run is not requeued."""
    _assert_resumed_identically(jobs, "requeue", reference)


def test_scancel_full_loses_at_most_the_steps_since_the_last_checkpoint(jobs, reference):
    """`scancel --signal=TERM --full` also signals srun, whose termination sequence kills the job step at
    once (SLURM's srun, not the toolkit): the run cannot save, but the batch script survives, requeues, and
    the job resumes from the last periodic checkpoint and ends identical."""
    _assert_resumed_identically(jobs, "scancel_full", reference, saved=False)


def _assert_failed_once(jobs, name: str, exit_code: str, message: str) -> None:
    job_id, out = jobs[name]
    info = wait_for(lambda: ended_or_requeued(job_id), f"the {name} job to end", 180)
    log = (out.parent / "job.log").read_text()
    assert (info["JobState"], info["Restarts"], info["ExitCode"]) == ("FAILED", "0", exit_code), log[-3000:]
    assert re.search(rf"^error: .*{re.escape(message)}", log, re.MULTILINE), log[-3000:]


def test_a_bad_flag_fails_the_job_once(jobs):
    """The run exits 2; `accelerate launch` reports its child's failure as 1, which the job ends with."""
    _assert_failed_once(jobs, "bad_flag", "1:0", "--no-such-flag")


def test_a_missing_recipe_fails_the_job_once_with_exit_2(jobs):
    _assert_failed_once(jobs, "missing_recipe", "2:0", "no_such_recipe.py")
