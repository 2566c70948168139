"""curves.png: a run's metrics.jsonl drawn, for those who would rather look than read."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from acceltrain.config.groups import PlotOptions
from acceltrain.config.options import ConfigError
from acceltrain.hooks.base import Hook
from acceltrain.runtime.run_folder import CURVES_FILE, METRICS_FILE


class Curves(Hook):
    """``<output_dir>/curves.png`` on the main process, drawn from the whole metrics.jsonl so that a
    resumed run's picture covers every launch: the training loss and the task's primary eval metric,
    against the optimizer step and against wall-clock seconds. Drawn when a launch ends, finished
    (``on_fit_end``, after the last row) or stopped to be resumed (``on_train_end``)."""

    def __init__(self):
        if importlib.util.find_spec("matplotlib") is None:  # said before training, not after it
            raise ConfigError("curves.png needs matplotlib: pip install matplotlib, or pass --no-plots")

    @classmethod
    def from_config(cls, cfg: PlotOptions) -> Curves | None:
        return cls() if cfg.plots else None

    def on_train_end(self, run) -> None:
        if run.stop is not None and not run.stop.finish:
            self._draw(run)

    def on_fit_end(self, run, summary: dict) -> None:
        self._draw(run)

    def _draw(self, run) -> None:
        if run.accelerator.is_main_process:
            rows = read_metrics(run.output_dir / METRICS_FILE)
            metric = f"eval_{run.task.primary_metric}" if run.eval_batches is not None else None
            curves_figure(rows, metric, title=run.output_dir.name).savefig(run.output_dir / CURVES_FILE, dpi=100)


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def curves_figure(rows: list[dict], metric: str | None, title: str):
    """A matplotlib Figure (no pyplot: no global backend is changed, PNG through Agg): one row of panels
    for the training loss, one for ``metric`` when there is one, each against step and against
    ``wall_seconds`` (from the first step, earlier launches included)."""
    from matplotlib.figure import Figure

    series = [("loss", "training loss")] + ([(metric, metric.replace("_", " "))] if metric else [])
    figure = Figure(figsize=(11, 3.2 * len(series)))
    axes = figure.subplots(len(series), 2, squeeze=False)
    for (key, label), (by_step, by_time) in zip(series, axes, strict=True):
        points = [row for row in rows if row.get(key) is not None]
        timed = [row for row in points if "wall_seconds" in row]
        style = {"marker": "o" if len(points) < 30 else None, "markersize": 3}
        by_step.plot([row["step"] for row in points], [row[key] for row in points], **style)
        by_time.plot([row["wall_seconds"] for row in timed], [row[key] for row in timed], **style)
        by_step.set_xlabel("optimizer step")
        by_time.set_xlabel("wall-clock seconds (evaluation included)")
        for axis in (by_step, by_time):
            axis.set_ylabel(label)
            axis.grid(alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    return figure
