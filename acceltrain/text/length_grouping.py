"""``--group-by-length``: batches of examples of similar lengths, so that padding per batch pads little, in an
order that is still a function of (seed, epoch) alone, so that a resumed run trains the same batches.

The loop's sampler (:class:`acceltrain.data.loaders.EpochSampler`) shuffles the epoch's indices by (seed, epoch), and
a dataset with ``sample(index, epoch)`` is read through it. :class:`LengthGrouped` computes that same order,
so that it knows the position each index is given, and hands out the example its own order puts there:
groups of ``GROUP_BATCHES`` batches drawn at random and sorted by length within (Transformers'
``LengthGroupedSampler``, its megabatches). Each position takes a different example, so every example is
trained once per epoch, whatever the process count (positions are global: Accelerate cuts them into each
process's batches)."""

from __future__ import annotations

import functools

import torch
from torch.utils.data import Dataset

from acceltrain.data.loaders import EpochSampler, mix_seed

GROUP_BATCHES = 50  # batches per group sorted by length (Transformers' megabatch)


class LengthGrouped(Dataset):
    """``dataset`` (with its examples' ``lengths``) read in length-grouped batches of ``batch_size`` by the loop
    of seed ``seed``; indexed as it is everywhere else (evaluation, the FLOP count)."""

    def __init__(self, dataset, lengths: list[int], *, batch_size: int, seed: int):
        if len(lengths) != len(dataset):
            raise ValueError(f"{len(lengths)} lengths for {len(dataset)} examples")
        self.dataset, self.lengths, self.batch_size, self.seed = dataset, torch.as_tensor(lengths), batch_size, seed
        self.fingerprint = getattr(dataset, "fingerprint", None)  # what a resume compares

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        return self.dataset[index]

    def sample(self, index: int, epoch: int):
        """The example at the position the loop's sampler gives ``index`` in ``epoch``."""
        return self.dataset[int(self._grouped(epoch)[self._positions(epoch)[index]])]

    def order(self, epoch: int) -> list[int]:
        """The examples in the order this epoch trains them (before the loop drops its last incomplete batch)."""
        return self._grouped(epoch).tolist()

    @functools.lru_cache(maxsize=2)  # noqa: B019 - one epoch at a time per loader worker; the dataset lives as long as the run
    def _positions(self, epoch: int) -> torch.Tensor:
        order = torch.as_tensor(EpochSampler(len(self), seed=self.seed).order(epoch))
        positions = torch.empty_like(order)
        positions[order] = torch.arange(len(order))
        return positions

    @functools.lru_cache(maxsize=2)  # noqa: B019
    def _grouped(self, epoch: int) -> torch.Tensor:
        shuffled = torch.randperm(len(self), generator=torch.Generator().manual_seed(mix_seed(self.seed, epoch, 0x1E6)))
        group = GROUP_BATCHES * self.batch_size
        groups = [
            indices[torch.argsort(self.lengths[indices], descending=True, stable=True)]
            for indices in shuffled.split(group)
        ]
        return torch.cat(groups)


def first_epoch_padding(train_set, lengths: list[int], *, batch_size: int, seed: int) -> float:
    """The share of padding tokens in the first epoch's batches of ``batch_size`` as the loop draws them (grouped
    by length when ``train_set`` is :class:`LengthGrouped`): what padding per batch still costs."""
    order = (
        train_set.order(0) if isinstance(train_set, LengthGrouped) else EpochSampler(len(train_set), seed=seed).order(0)
    )
    batches = [order[start : start + batch_size] for start in range(0, len(order) - batch_size + 1, batch_size)]
    padded = sum(len(batch) * max(lengths[index] for index in batch) for batch in batches)
    return 1 - sum(lengths[index] for batch in batches for index in batch) / padded if padded else 0.0
