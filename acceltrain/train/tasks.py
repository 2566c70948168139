"""What the loop computes on a batch. A task turns a batch into a training loss and into per-sample
evaluation values; the loop sums those values over the whole evaluation set, exactly, across
processes (``gather_for_metrics``). Write your own for another kind of model: :class:`Task` names
everything the loop reads, and ``fit()`` checks a task against it before any training."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from acceltrain.config.options import ConfigError
from acceltrain.vision.names import TTA_MODES


class Task(Protocol):
    """What ``fit(task=...)`` needs. Subclass it to inherit the optional attributes' defaults, or write any
    object with the same names.

    Required: ``train_loss(model, batch)``, a scalar loss to minimise, or ``(loss sum, target count)``
    to have the gradient divided by the target count of the whole accumulation window on all processes
    (set ``sums_losses = True`` then). With an eval set also ``eval_values(model, batch)`` ->
    ``{name: per-sample tensor}``, ``primary_metric`` (one of those names, or of ``eval_metrics``' keys:
    what ``--keep-best`` and ``--target-metric`` read) and ``higher_is_better``.

    Optional: ``eval_metrics(sums, samples)`` turns the eval values summed over the eval set into metrics
    (default: their means; a task without the method gets the same); ``flops_per_sample`` (default:
    counted with torch's FLOP counter); ``tokens_per_sample`` (tokens/s is reported when set);
    ``eval_views`` (forward passes per evaluated sample, default 1; a time budget plans with it);
    ``check_batch(batch)``: what is wrong with a batch for this task, or None (``fit()`` asks it of the first batch the
    collate function makes, before training).
    """

    primary_metric: str
    higher_is_better: bool
    flops_per_sample: float | None = None
    tokens_per_sample: int | None = None
    sums_losses: bool = False

    def train_loss(self, model: nn.Module, batch) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...

    def eval_values(self, model: nn.Module, batch) -> dict[str, torch.Tensor]: ...

    def eval_metrics(self, sums: dict[str, float], samples: int) -> dict[str, float]:
        """The eval values summed over the whole eval set -> metrics; by default their means."""
        return {key: total / samples for key, total in sums.items()}


def check_first_batch(task, batch, collate_fn) -> None:
    """The first batch the collate function makes, checked against what the task takes: one line naming the
    function, instead of an error deep inside the model or the loss (or, for None, an epoch that ends at once)."""
    name = getattr(collate_fn, "__qualname__", None) or type(collate_fn).__name__
    if batch is None:
        raise ConfigError(
            f"the collate function {name} returned None (a missing return?): it must return a batch "
            f"{type(task).__name__} takes"
        )
    check = getattr(task, "check_batch", None) if _checks_its_own_batches(task) else None
    problem = check(batch) if check is not None else None
    if problem:
        raise ConfigError(f"the collate function {name} returned {problem}")


def _checks_its_own_batches(task) -> bool:
    """Whether ``task``'s ``check_batch`` knows the batches its ``train_loss`` takes: not when a subclass reads batches
    of another form (a dict) and inherits its parent's check."""

    def definer(name):
        return next((cls for cls in type(task).__mro__ if name in vars(cls)), None)

    checker, trainer = definer("check_batch"), definer("train_loss")
    return checker is not None and (trainer is None or issubclass(checker, trainer))


def describe(value) -> str:
    """A short description of a batch or part of one, for an error message."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} items"
    if isinstance(value, Mapping):
        return f"a mapping of {', '.join(map(str, list(value)[:6]))}"
    return f"a {type(value).__name__}"


def labels_problem(labels) -> str | None:
    """What is wrong with a batch's class labels (an integer tensor), or None."""
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.dtype == torch.bool:
        return f"labels as {describe(labels)}: class labels must be an integer tensor (class ids 0..K-1)"
    return None


def check_task(task, evaluates: bool) -> None:
    """A one-line ConfigError naming the first attribute the loop would miss, before any training."""
    name = type(task).__name__
    required = {"train_loss": callable}
    if evaluates:
        required.update(
            eval_values=callable,
            primary_metric=lambda v: isinstance(v, str),
            higher_is_better=lambda v: isinstance(v, bool),
        )
    for attribute, valid in required.items():
        if not hasattr(task, attribute):
            raise ConfigError(
                f"task {name} has no {attribute!r}: a task needs {', '.join(required)} (see acceltrain.Task)"
            )
        if not valid(getattr(task, attribute)):
            raise ConfigError(
                f"task {name}.{attribute} = {getattr(task, attribute)!r} is invalid (see acceltrain.Task)"
            )


class ClassificationTask(Task):
    """Batches are ``(inputs, labels)``; trains on cross-entropy (optionally label-smoothed) and
    evaluates per-sample loss and accuracy.

    ``tta`` (test-time augmentation, evaluation only): ``flip`` averages the logits of each image and of
    its mirror image; ``flip-translate`` (airbench's level 2, arXiv 2404.00498) gives that average weight
    1/2 and the same average over the image shifted by one pixel down-right and up-left (reflect padding)
    1/4 each. Logits rather than probabilities, as airbench does; the eval loss and accuracy are those of
    the averaged logits. The views go through the model as one batch."""

    primary_metric = "accuracy"
    higher_is_better = True
    tta_modes = TTA_MODES

    def __init__(self, label_smoothing: float = 0.0, tta: str = "none"):
        if tta not in self.tta_modes:
            raise ConfigError(f"tta {tta!r} is invalid: choose one of {', '.join(self.tta_modes)}")
        self.label_smoothing = label_smoothing
        self.tta = tta

    def train_loss(self, model: nn.Module, batch) -> torch.Tensor:
        inputs, labels = batch
        return F.cross_entropy(model(inputs), labels, label_smoothing=self.label_smoothing)

    def check_batch(self, batch) -> str | None:
        if not (isinstance(batch, (list, tuple)) and len(batch) == 2):
            return f"{describe(batch)}; {type(self).__name__} takes an (inputs, labels) pair"
        return labels_problem(batch[1])

    def eval_values(self, model: nn.Module, batch) -> dict[str, torch.Tensor]:
        inputs, labels = batch
        logits = self.eval_logits(model, inputs)
        return {
            "loss": F.cross_entropy(logits.float(), labels, reduction="none"),
            "accuracy": (logits.argmax(dim=-1) == labels).float(),
        }

    @property
    def eval_views(self) -> int:
        """Forward passes per evaluated image: what an evaluation costs, for planning a time budget."""
        return {"none": 1, "flip": 2, "flip-translate": 6}[self.tta]

    def eval_logits(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        """The model's logits for an image batch (N, C, H, W), averaged over the ``tta`` views."""
        if self.tta == "none":
            return model(inputs)
        views, weights = [inputs], [1.0]
        if self.tta == "flip-translate":
            height, width = inputs.shape[-2:]
            padded = F.pad(inputs, (1, 1, 1, 1), mode="reflect")
            views, weights = [inputs, padded[..., :height, :width], padded[..., 2:, 2:]], [0.5, 0.25, 0.25]
        views, weights = [*views, *(view.flip(-1) for view in views)], [w / 2 for w in weights] * 2
        logits = model(torch.cat(views)).unflatten(0, (len(views), len(inputs)))
        return torch.einsum("v,vnk->nk", logits.new_tensor(weights), logits)
