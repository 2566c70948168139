"""curves.png: drawn from the whole metrics.jsonl when a launch ends, finished or stopped to resume."""

from __future__ import annotations

import importlib.util

import pytest
from conftest import read_events, run_tiny_in_process

from acceltrain import ConfigError
from acceltrain.hooks.plots import CURVES_FILE, Curves, curves_figure

RUN = [
    "--num-train",
    "32",
    "--batch-size",
    "8",
    "--max-steps",
    "6",
    "--log-every",
    "1",
    "--eval-every",
    "2",
    "--no-progress",
    "--num-workers",
    "0",
    "--report-to",
    "none",
    "--plots",  # the tests' own recipe leaves them out
]
PNG = b"\x89PNG"


def test_curves_show_loss_and_the_eval_metric_against_step_and_seconds():
    rows = [
        {"step": 1, "loss": 2.0, "wall_seconds": 0.5},
        {"step": 2, "loss": 1.5, "wall_seconds": 1.0},
        {"step": 2, "eval_accuracy": 0.3, "eval_loss": 1.7, "wall_seconds": 1.2},
        {"step": 3, "loss": 1.0, "wall_seconds": 1.6},
    ]
    figure = curves_figure(rows, "eval_accuracy", title="run")
    (loss_by_step, loss_by_time), (metric_by_step, metric_by_time) = [figure.axes[i : i + 2] for i in (0, 2)]
    assert list(loss_by_step.lines[0].get_xdata()) == [1, 2, 3] and list(loss_by_time.lines[0].get_xdata()) == [
        0.5,
        1.0,
        1.6,
    ]
    assert list(metric_by_step.lines[0].get_ydata()) == [0.3] and list(metric_by_time.lines[0].get_xdata()) == [1.2]
    assert metric_by_step.get_ylabel() == "eval accuracy" and loss_by_time.get_xlabel().startswith("wall-clock seconds")


def test_without_an_eval_set_only_the_loss_is_drawn():
    assert len(curves_figure([{"step": 1, "loss": 2.0}], None, title="run").axes) == 2


def test_a_finished_run_writes_curves_png(tmp_path):
    assert run_tiny_in_process(tmp_path / "run", *RUN) == 0
    assert (tmp_path / "run" / CURVES_FILE).read_bytes()[:4] == PNG


def test_a_stopped_run_writes_them_and_its_resume_redraws_them_over_every_step(tmp_path):
    out = tmp_path / "run"
    assert run_tiny_in_process(out, *RUN, "--stop-after-steps", "3") == 75
    assert (out / CURVES_FILE).read_bytes()[:4] == PNG
    (out / CURVES_FILE).unlink()
    assert run_tiny_in_process(out, *RUN, "--resume", "auto") == 0
    assert (out / CURVES_FILE).read_bytes()[:4] == PNG
    assert [row["step"] for row in read_events(out) if "loss" in row] == [1, 2, 3, 4, 5, 6]


def test_without_matplotlib_the_hook_refuses_before_training(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *args: None if name == "matplotlib" else real_find_spec(name, *args)
    )
    with pytest.raises(ConfigError, match="curves.png needs matplotlib: pip install matplotlib, or pass --no-plots"):
        Curves()
