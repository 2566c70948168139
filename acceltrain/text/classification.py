"""Sequence classification with a Transformers model: the task (cross-entropy on the head's logits; accuracy and
macro-F1 while training) and the per-class figures of a confusion matrix.

Every evaluation sums, per sample, one count of each (true class, predicted class) cell, so the confusion
matrix, and everything read from it, is exact across processes like any other eval value; the task keeps the
last one for the end-of-run report (:class:`~acceltrain.text.classification_report.ClassificationReport`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from acceltrain.config.options import ConfigError
from acceltrain.train.tasks import Task, describe, labels_problem


def _is_pair(batch) -> bool:
    """An ``(inputs, labels)`` tuple (a list is taken for a list of samples:
    a collate function that collated nothing)."""
    return isinstance(batch, tuple) and len(batch) == 2 and isinstance(batch[0], Mapping)


def split(batch) -> tuple[Mapping, torch.Tensor]:
    """(the model's inputs, the labels) of a batch: a mapping with ``labels``, or an ``(inputs, labels)`` pair."""
    if _is_pair(batch):
        return batch[0], batch[1]
    return {key: value for key, value in batch.items() if key != "labels"}, batch["labels"]


class TextClassificationTask(Task):
    """Batches are a tokenizer's padded output with ``labels``, or an ``(inputs, labels)`` pair of the two;
    ``labels`` names the classes in order.
    ``tokens_per_sample`` and ``flops_per_sample`` (optional) are an example's mean: tokens/s and MFU are reported
    with them (torch's FLOP counter cannot count a Transformers encoder, whose mask code reads tensor values).
    ``label_smoothing`` and ``class_weights`` (one per class, :func:`balanced_class_weights`) shape the training loss
    alone: ``eval_loss`` stays the plain cross-entropy, comparable between runs."""

    primary_metric = "accuracy"
    higher_is_better = True

    def __init__(
        self,
        labels: list[str],
        *,
        tokens_per_sample: float | None = None,
        flops_per_sample: float | None = None,
        label_smoothing: float = 0.0,
        class_weights: list[float] | None = None,
    ):
        self.labels = list(labels)
        self.tokens_per_sample, self.flops_per_sample = tokens_per_sample, flops_per_sample
        self.label_smoothing = label_smoothing
        self.class_weights = torch.tensor(class_weights, dtype=torch.float32) if class_weights is not None else None
        self.confusion: list[list[int]] | None = None  # of the last evaluation: [true class][predicted class]

    def logits_and_labels(self, model: nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, labels = split(batch)
        return model(**inputs).logits.float(), labels

    def train_loss(self, model: nn.Module, batch) -> torch.Tensor:
        logits, labels = self.logits_and_labels(model, batch)
        weights = self.class_weights.to(logits.device) if self.class_weights is not None else None
        return F.cross_entropy(logits, labels, weight=weights, label_smoothing=self.label_smoothing)

    def check_batch(self, batch) -> str | None:
        if not (isinstance(batch, Mapping) and "labels" in batch or _is_pair(batch)):
            return (
                f"{describe(batch)}; {type(self).__name__} takes a mapping of the model's inputs and 'labels' (a "
                "tokenizer's padded output), or an (inputs, labels) pair"
            )
        return labels_problem(split(batch)[1])

    def eval_values(self, model: nn.Module, batch) -> dict[str, torch.Tensor]:
        logits, labels = self.logits_and_labels(model, batch)
        classes = len(self.labels)
        cells = F.one_hot(labels * classes + logits.argmax(dim=-1), classes * classes).T.float()
        return {
            "loss": F.cross_entropy(logits, labels, reduction="none"),
            **{f"confusion_{i}": cell for i, cell in enumerate(cells)},
        }

    def eval_metrics(self, sums: dict[str, float], samples: int) -> dict[str, float]:
        classes = len(self.labels)
        self.confusion = [
            [round(sums[f"confusion_{true * classes + predicted}"]) for predicted in range(classes)]
            for true in range(classes)
        ]
        report = per_class(self.confusion, self.labels)
        return {"loss": sums["loss"] / samples, "accuracy": report["accuracy"], "macro_f1": report["macro_f1"]}


def balanced_class_weights(labels: list[int], names: list[str]) -> list[float]:
    """scikit-learn's ``class_weight="balanced"``: class c weighs ``samples / (classes x count of c)`` in the loss, so
    every class counts as much in total; a class without a training example is one line (its weight would be
    infinite)."""
    counts = torch.bincount(torch.as_tensor(labels), minlength=len(names)).tolist()
    if 0 in counts:
        raise ConfigError(
            f"--class-weights balanced: class {names[counts.index(0)]!r} has no training example to weigh"
        )
    return [len(labels) / (len(names) * count) for count in counts]


def per_class(confusion: list[list[int]], labels: list[str]) -> dict:
    """Precision, recall, F1 and support of each class, accuracy, and the macro-F1: the mean F1 of the classes
    that occur among the true labels or the predictions (scikit-learn's choice); a class never predicted has
    precision 0, one never true recall 0."""
    classes = range(len(labels))
    support = [sum(confusion[true]) for true in classes]
    predicted = [sum(row[index] for row in confusion) for index in classes]
    figures, scored = {}, []
    for index in classes:
        hits = confusion[index][index]
        precision = hits / predicted[index] if predicted[index] else 0.0
        recall = hits / support[index] if support[index] else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        figures[labels[index]] = {"precision": precision, "recall": recall, "f1": f1, "support": support[index]}
        if support[index] or predicted[index]:
            scored.append(f1)
    total = sum(support)
    return {
        "accuracy": sum(confusion[index][index] for index in classes) / total if total else 0.0,
        "macro_f1": sum(scored) / len(scored) if scored else 0.0,
        "per_class": figures,
        "labels": list(labels),
        "confusion_matrix": confusion,
    }
