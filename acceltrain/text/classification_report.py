"""The end-of-run report of a classifier: the final model's per-class precision, recall, F1 and support, and its
confusion matrix, as ``classification_report.json`` and ``confusion_matrix.png`` in the run folder."""

from __future__ import annotations

import json

from acceltrain.hooks.base import Hook
from acceltrain.runtime.run_folder import REPORT_FILE
from acceltrain.text.classification import TextClassificationTask, per_class

CONFUSION_FILE = "confusion_matrix.png"


class ClassificationReport(Hook):
    """Reads the task's confusion matrix of the final evaluation (evaluating once more when the last one was
    not at the final step); the summary gets ``per_class_f1`` (class -> F1 of the final evaluation)."""

    def __init__(self, task: TextClassificationTask):
        self.task = task

    def on_fit_end(self, run, summary: dict) -> None:
        if run.eval_batches is None:
            return
        if run.last_eval_step != run.step or self.task.confusion is None:
            run.evaluate()
        report = {"step": run.step, **per_class(self.task.confusion, self.task.labels)}
        summary["per_class_f1"] = {label: figures["f1"] for label, figures in report["per_class"].items()}
        if run.accelerator.is_main_process:
            (run.output_dir / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
            confusion_figure(
                report["confusion_matrix"], report["labels"], title=f"{run.output_dir.name}, step {run.step}"
            ).savefig(run.output_dir / CONFUSION_FILE, dpi=100)


def confusion_figure(confusion: list[list[int]], labels: list[str], title: str):
    """A matplotlib Figure (no pyplot: no global backend changed) of the counts, true classes down, predicted
    classes across, each cell written in."""
    from matplotlib.figure import Figure

    size = min(12.0, 2.5 + 0.5 * len(labels))
    figure = Figure(figsize=(size, size))
    axis = figure.subplots()
    image = axis.imshow(confusion, cmap="Blues")
    figure.colorbar(image, ax=axis, fraction=0.046)
    shown = [label if len(label) <= 16 else label[:15] + "…" for label in labels]
    axis.set_xticks(range(len(labels)), shown, rotation=45, ha="right")
    axis.set_yticks(range(len(labels)), shown)
    axis.set_xlabel("predicted class")
    axis.set_ylabel("true class")
    brightest = max((max(row) for row in confusion), default=0)
    if len(labels) <= 30:  # beyond, the numbers would not fit their cells
        for true, row in enumerate(confusion):
            for predicted, count in enumerate(row):
                axis.text(
                    predicted,
                    true,
                    str(count),
                    ha="center",
                    va="center",
                    color="white" if count > brightest / 2 else "black",
                )
    axis.set_title(title)
    figure.tight_layout()
    return figure
