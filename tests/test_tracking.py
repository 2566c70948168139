"""W&B (offline, read back from the .wandb file with wandb's own protobuf records) and TensorBoard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TINY_RECIPE, check, launch, read_events, read_summary

from acceltrain.runtime.tracking import read_offline_run

RUN = ["--batch-size", "8", "--log-every", "1", "--eval-every", "3", "--no-progress", "--num-workers", "0"]


def offline_runs(output_dir: Path) -> list[dict]:
    return [read_offline_run(d) for d in sorted((output_dir / "wandb").glob("offline-run-*"))]


SECRET = "acceltraintestsecret0123456789abcdef0123456789"  # the shape of a W&B key: 40+ characters


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory):
    """One launch for the W&B offline run, TensorBoard beside it (``--report-to all``) and an API key in the
    environment that must never be written or printed (checkpoints too)."""
    out = tmp_path_factory.mktemp("wandb") / "run"
    result = check(
        launch(
            TINY_RECIPE,
            [
                *RUN,
                "--max-steps",
                "6",
                "--output-dir",
                str(out),
                "--run-name",
                "tiny-offline",
                "--wandb-tags",
                "a,b",
                "--log-model",
                "--report-to",
                "all",
                "--save-every-steps",
                "2",
            ],
            WANDB_MODE="offline",
            WANDB_API_KEY=SECRET,
        )
    )
    return out, result


@pytest.mark.slow
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


@pytest.mark.slow
def test_wandbs_own_lines_stay_out_of_the_log(offline_run):
    """Before: 34 of a LoRA run's 169 lines were wandb's banner and run summary; the toolkit's one W&B line says
    where the run went and how to upload it."""
    _, result = offline_run
    output = result.stdout + result.stderr
    assert "wandb:" not in output, [line for line in output.splitlines() if "wandb:" in line][:5]
    assert output.count("W&B: logging offline; upload later with: wandb sync ") == 1


@pytest.mark.slow
def test_two_processes_make_one_wandb_run(tmp_path):
    out = tmp_path / "run"
    check(
        launch(
            TINY_RECIPE,
            [*RUN, "--max-steps", "3", "--output-dir", str(out)],
            processes=2,
            launcher="accelerate",
            WANDB_MODE="offline",
        )
    )
    assert len(offline_runs(out)) == 1
    assert not (out / "logs").exists(), "TensorBoard only when asked for"


@pytest.mark.slow
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
    state = json.loads(next((out / "checkpoints").glob("step_*/hooks/Trackers.json")).read_text())
    assert state["run_id"] == first["id"]  # the Trackers hook's own state_dict()


@pytest.mark.slow
def test_without_api_key_wandb_goes_offline_and_says_how_to_sync(tmp_path):
    out = tmp_path / "run"
    result = launch(
        TINY_RECIPE,
        [*RUN, "--max-steps", "2", "--output-dir", str(out)],
        WANDB_MODE="",
        HOME=str(tmp_path),
        NETRC=str(tmp_path / "no-netrc"),
    )
    check(result)
    assert "no W&B API key found" in result.stdout and "wandb sync " in result.stdout
    assert len(offline_runs(out)) == 1


@pytest.mark.slow
def test_api_key_is_never_written_or_printed(offline_run):
    out, result = offline_run
    assert SECRET not in result.stdout + result.stderr
    assert list((out / "checkpoints").glob("step_*")), "checkpoints were written too"
    for file in out.rglob("*"):
        if file.is_file():
            assert SECRET.encode() not in file.read_bytes(), file


@pytest.mark.slow
def test_tensorboard_writes_the_same_scalars(offline_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = offline_run
    accumulators = [EventAccumulator(str(f.parent)).Reload() for f in (out / "logs").rglob("events.out.tfevents.*")]
    (scalars,) = [a for a in accumulators if "loss" in a.Tags()["scalars"]]
    logged = {e.step: e.value for e in scalars.Scalars("loss")}
    expected = {e["step"]: e["loss"] for e in read_events(out) if "loss" in e}
    assert logged == pytest.approx(expected)


@pytest.fixture
def wandb_stand_in():
    """A local stand-in for the W&B server: ``server(status, body)`` answers every request with them and
    returns its URL (no network needed)."""
    import http.server
    import threading

    servers = []

    def server(status: int, body: dict) -> str:
        payload = json.dumps(body).encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_HEAD = _answer

            def log_message(self, *args):
                pass

        instance = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=instance.serve_forever, daemon=True).start()
        servers.append(instance)
        return f"http://127.0.0.1:{instance.server_address[1]}"

    yield server
    for instance in servers:
        instance.shutdown()


@pytest.fixture
def silent_port():
    """A port that accepts connections and never answers: a server lost behind a firewall."""
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def closed_port() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def launch_online(tmp_path: Path, base_url: str):
    """The tiny recipe with W&B online (a key in the environment) against ``base_url``; returns the result
    and its wall time."""
    import time

    started = time.perf_counter()
    result = launch(
        TINY_RECIPE,
        [*RUN, "--max-steps", "2", "--output-dir", str(tmp_path / "run")],
        timeout=150,
        WANDB_MODE="",
        WANDB_API_KEY=SECRET,
        WANDB_BASE_URL=base_url,
        HOME=str(tmp_path),
        NETRC=str(tmp_path / "no-netrc"),
    )
    return result, time.perf_counter() - started


def assert_one_line_error_before_training(result, tmp_path: Path, seconds: float, *phrases: str) -> str:
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "Traceback" not in output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert all(phrase in errors[0] for phrase in phrases), errors[0]
    # a hang guard, not a speed test: without the probe wandb.init waits out its init_timeout (90 s) on any
    # machine; with it, the launch takes 3-8 s here (a silent port: the 5 s probe)
    assert seconds < 90, f"{seconds:.0f} s: before the probe it took about 105 s"
    assert not (tmp_path / "run").exists(), "refused before anything was written"
    assert SECRET not in output
    for file in tmp_path.rglob("*"):
        if file.is_file():
            assert SECRET.encode() not in file.read_bytes(), file
    return errors[0]


@pytest.mark.slow
def test_rejected_wandb_key_is_one_line_in_seconds(tmp_path, wandb_stand_in):
    url = wandb_stand_in(401, {"errors": [{"message": "user is not logged in"}]})
    result, seconds = launch_online(tmp_path, url)
    assert_one_line_error_before_training(
        result, tmp_path, seconds, f"W&B at {url} rejected", "$WANDB_API_KEY", "--wandb-mode offline"
    )


@pytest.mark.slow
@pytest.mark.parametrize("where", ["closed port", "silent port"])
def test_unreachable_wandb_is_one_line_in_seconds(tmp_path, where, request):
    url = closed_port() if where == "closed port" else request.getfixturevalue("silent_port")
    result, seconds = launch_online(tmp_path, url)
    assert_one_line_error_before_training(
        result,
        tmp_path,
        seconds,
        f"W&B at {url} is unreachable",
        "--wandb-mode offline",
        "wandb sync",
        "--report-to none",
    )


@pytest.fixture
def fresh_wandb(monkeypatch, tmp_path):
    """wandb's settings singleton reads the environment once: a fresh one before and after the test."""
    import wandb

    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    wandb.teardown()
    yield
    wandb.teardown()


def test_wandb_online_check_passes_a_server_that_accepts_the_key(monkeypatch, wandb_stand_in, fresh_wandb):
    from acceltrain.runtime.tracking import check_wandb_online

    url = wandb_stand_in(200, {"data": {"viewer": {"id": "VXNlcjox", "entity": "someone", "username": "someone"}}})
    monkeypatch.setenv("WANDB_BASE_URL", url)
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    check_wandb_online()


def test_wandb_mode_online_without_credentials_is_one_line(monkeypatch, wandb_stand_in, fresh_wandb):
    from acceltrain import ConfigError
    from acceltrain.runtime.tracking import check_wandb_online

    monkeypatch.setenv("WANDB_BASE_URL", wandb_stand_in(401, {}))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with pytest.raises(
        ConfigError, match=r"W&B online needs credentials \(No API key configured.*--wandb-mode offline"
    ):
        check_wandb_online()


def test_a_wandb_login_for_wandbs_default_host_counts_as_credentials(tmp_path, monkeypatch):
    """`wandb login` writes ~/.netrc for wandb's own default host (not necessarily api.wandb.ai)."""
    from urllib.parse import urlparse

    import wandb

    from acceltrain import TrainConfig
    from acceltrain.runtime.tracking import wandb_mode

    netrc_file = tmp_path / "netrc"
    netrc_file.write_text(
        f"machine {urlparse(wandb.Settings().base_url).hostname}\n  login user\n  password {SECRET}\n"
    )
    netrc_file.chmod(0o600)
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(netrc_file))
    assert wandb_mode(TrainConfig()) == "online"
