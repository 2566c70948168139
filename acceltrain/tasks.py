"""What the loop computes on a batch. A task turns a batch into a training loss and into per-sample
evaluation values; the loop averages those values over the whole evaluation set, exactly, across
processes (``gather_for_metrics``). Write your own for another kind of model."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ClassificationTask:
    """Batches are ``(inputs, labels)``; trains on cross-entropy (optionally label-smoothed) and
    evaluates per-sample loss and accuracy."""

    primary_metric = "accuracy"  # what --keep-best and --target-accuracy look at
    higher_is_better = True

    def __init__(self, label_smoothing: float = 0.0):
        self.label_smoothing = label_smoothing

    def train_loss(self, model: nn.Module, batch) -> torch.Tensor:
        inputs, labels = batch
        return F.cross_entropy(model(inputs), labels, label_smoothing=self.label_smoothing)

    def eval_values(self, model: nn.Module, batch) -> dict[str, torch.Tensor]:
        inputs, labels = batch
        logits = model(inputs)
        return {
            "loss": F.cross_entropy(logits.float(), labels, reduction="none"),
            "accuracy": (logits.argmax(dim=-1) == labels).float(),
        }
