"""The toolkit's messages go through Python's ``logging`` (the ``acceltrain`` logger), so ``--log-level``
silences them and a handler of your own receives them; the one-line ``error:`` shows at every level, and
the libraries' noise (DeepSpeed's "Setting accelerator to CPU") stays out of a normal run."""

from __future__ import annotations

import importlib.util
import logging

import pytest
from conftest import TINY_RECIPE, check, launch, read_summary, run_tiny_in_process

from acceltrain.runtime.logs import set_log_level

TINY = [
    "--num-train",
    "32",
    "--num-eval",
    "16",
    "--batch-size",
    "8",
    "--epochs",
    "1",
    "--log-every",
    "2",
    "--num-workers",
    "0",
    "--report-to",
    "none",
    "--no-plots",
    "--no-progress",
]
START_LINES = ("data:", "model:", "engine:", "steps:", "checkpoints:", "outputs:")
INFO_LINES = (*START_LINES, "step=", "done: ")


@pytest.fixture(autouse=True)
def default_log_level():
    """A run's --log-level stays set in this process: the next test starts from the default again."""
    yield
    set_log_level("info")


def test_default_level_prints_the_config_the_metric_rows_and_done_as_plain_lines(tmp_path, capsys):
    assert run_tiny_in_process(tmp_path / "run", *TINY) == 0
    lines = capsys.readouterr().out.splitlines()
    for start in INFO_LINES:
        assert any(line.startswith(start) for line in lines), f"no line starts with {start!r}:\n" + "\n".join(lines)
    assert not any("[RANK" in line or " - INFO - " in line for line in lines), "plain lines, as printed before logging"


def test_the_start_up_says_what_data_model_engine_and_steps_in_six_lines(tmp_path, capsys):
    """Before: a ~105-line dump of the config and runtime opened every run, and no line said what data it read."""
    assert run_tiny_in_process(tmp_path / "run", *TINY) == 0
    lines = capsys.readouterr().out.splitlines()
    start = lines[: lines.index(next(line for line in lines if line.startswith("step=")))]
    assert [line.split(":")[0] + ":" for line in start] == list(START_LINES), start
    assert start[0] == "data: 32 training rows, 16 eval rows, 10 classes"
    assert start[2] == "engine: one process on cpu, mixed precision no", "the engine's own name, said once"
    assert start[3] == "steps: 4 (4 an epoch), 8 samples a step (--batch-size 8 x 1 process x --grad-accum 1)"
    assert "config:" not in lines and lines[-1].startswith("done: 4 steps, train loss ")
    loss = lines[-1].split("train loss ")[1].split(",")[0]
    assert len(loss.replace(".", "").lstrip("0")) <= 4, f"rounded to 4 digits, not {loss}"
    assert "lr_schedule: cosine" in (tmp_path / "run" / "train_config.yaml").read_text(), "the whole config is kept"


def test_log_level_warning_silences_info_yet_writes_the_run(tmp_path, capsys):
    assert run_tiny_in_process(tmp_path / "run", *TINY, "--log-level", "warning") == 0
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
    assert read_summary(tmp_path / "run")["steps"] == 4 and (tmp_path / "run" / "metrics.jsonl").is_file()


def test_an_error_is_still_one_line_at_log_level_error(tmp_path, capsys):
    assert run_tiny_in_process(tmp_path / "run", *TINY, "--batch-size", "1000", "--log-level", "error") == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("error: --batch-size 1000 is too large")
    assert captured.err.count("\n") == 1


def test_a_handler_attached_to_the_acceltrain_logger_receives_the_records(tmp_path, caplog, capsys):
    toolkit = logging.getLogger("acceltrain")
    toolkit.addHandler(caplog.handler)
    try:
        assert run_tiny_in_process(tmp_path / "run", *TINY) == 0
    finally:
        toolkit.removeHandler(caplog.handler)
    done = [record for record in caplog.records if "done: 4 steps" in record.getMessage()]
    assert len(done) == 1 and done[0].name == "acceltrain.train.loop" and done[0].levelno == logging.INFO
    assert any(
        record.name == "acceltrain.hooks.logging" and "step=4" in record.getMessage() for record in caplog.records
    )
    assert "done: 4 steps" in capsys.readouterr().out, "the console handler still prints"


def test_log_level_debug_shows_time_level_and_logger_name(tmp_path, capsys):
    assert run_tiny_in_process(tmp_path / "run", *TINY, "--log-level", "debug") == 0
    out = capsys.readouterr().out
    done = [line for line in out.splitlines() if "done: " in line]
    assert len(done) == 1 and " - INFO - acceltrain.train.loop - " in done[0], done
    assert "config:\n" in out and "runtime:\n" in out, "the whole config and runtime at debug"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="the warning comes from DeepSpeed")
def test_deepspeeds_setting_accelerator_to_cpu_warning_stays_out_of_a_cpu_run(tmp_path):
    """Once the deepspeed extra is installed, DeepSpeed logs it on its own stdout handler in every CPU run."""
    result = check(launch(TINY_RECIPE, [*TINY, "--output-dir", str(tmp_path / "run")]))
    assert "done: " in result.stdout
    assert "Setting accelerator to CPU" not in result.stdout + result.stderr


def test_log_level_wins_over_a_level_that_accelerate_log_level_gave_a_modules_logger(monkeypatch, capsys):
    """accelerate's get_logger gives each logger it makes the level in $ACCELERATE_LOG_LEVEL (its documented knob)."""
    from accelerate import PartialState
    from accelerate.logging import get_logger

    PartialState(cpu=True)
    root_level = logging.root.level
    monkeypatch.setenv("ACCELERATE_LOG_LEVEL", "info")
    probe = get_logger("acceltrain.probe")  # as a module imported with the variable set makes its logger
    logging.root.setLevel(root_level)  # accelerate's get_logger sets the root logger's level too
    try:
        set_log_level("warning")
        probe.info("hidden")
        probe.warning("shown")
        assert capsys.readouterr().out == "warning: shown\n"
    finally:
        probe.logger.setLevel(logging.NOTSET)
