"""``--eval-samples N``: evaluate on a fixed random subset instead of the whole eval set.

The subset depends only on the seed and the dataset, never on the process count, so 1 and 8 processes
evaluate the same samples; with labels it keeps every class's share of the eval set (to within one).
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, Subset

from acceltrain.data.loaders import mix_seed
from acceltrain.config.options import ConfigError

EVAL_SUBSET_STREAM = 0xE7A1  # keeps these draws apart from the training order's, which use the same seed


def eval_subset_indices(
    count: int, seed: int, *, size: int | None = None, labels: torch.Tensor | None = None
) -> list[int]:
    """``count`` sorted indices out of ``size`` samples (or ``len(labels)``), drawn with ``seed``: per class
    when ``labels`` are given (each class gets its share, the remainders going to the largest fractions),
    else uniformly."""
    total = len(labels) if labels is not None else size
    if count > total:
        raise ConfigError(
            f"--eval-samples {count} is invalid: the eval set has only {total} samples; give at most {total} or leave "
            "it unset"
        )
    generator = torch.Generator().manual_seed(mix_seed(seed, EVAL_SUBSET_STREAM))
    if labels is None:
        return sorted(torch.randperm(total, generator=generator)[:count].tolist())
    labels = torch.as_tensor(labels)
    classes, class_sizes = labels.unique(return_counts=True)
    shares = class_sizes.double() * count / total
    quotas = shares.floor().long()
    leftover = count - int(quotas.sum())
    by_remainder = sorted(range(len(classes)), key=lambda c: (-(shares[c] - quotas[c]).item(), c))  # ties: lower class
    for c in by_remainder[:leftover]:
        quotas[c] += 1
    chosen = []
    for label, quota in zip(classes.tolist(), quotas.tolist()):
        members = (labels == label).nonzero().flatten()
        chosen += members[torch.randperm(len(members), generator=generator)[:quota]].tolist()
    return sorted(chosen)


def eval_subset(dataset: Dataset, count: int, seed: int) -> Subset:
    """The ``count``-sample subset of ``dataset`` that every process evaluates; stratified by
    ``dataset.labels`` when the dataset has them (:class:`acceltrain.vision.ImageClassification` does)."""
    labels = getattr(dataset, "labels", None)
    return Subset(dataset, eval_subset_indices(count, seed, size=len(dataset), labels=labels))
