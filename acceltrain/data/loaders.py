"""Sampling and DataLoaders, built so that a sample's augmentation never depends on the process count,
the batch size, the worker that loads it, or what that worker loaded before.

The training sampler yields ``(epoch, index)`` keys in one global, seeded order that every process
computes identically; Accelerate then shards the batches across processes. A dataset that defines
``sample(index, epoch)`` derives its augmentation randomness from ``(seed, epoch, index)`` alone.
So 2 processes at batch b see the same samples, augmented the same way, as 1 process at batch 2b,
and a resumed run sees the same remaining batches as the uninterrupted one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from acceltrain.runtime.preemption import ignore_stop_signals


def mix_seed(*parts: int) -> int:
    """A deterministic 63-bit seed from integers (splitmix64 steps), stable across processes and runs."""
    state = 0x9E3779B97F4A7C15
    for part in parts:
        state = (state ^ (int(part) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        state = (state ^ (state >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        state ^= state >> 31
    return state & 0x7FFFFFFFFFFFFFFF


# --------------------------------------------------------------------------- sampling


class EpochSampler(Sampler):
    """Yields ``(epoch, index)`` for every sample, shuffled by ``(seed, epoch)`` when ``shuffle``.

    The order is the same on every process; Accelerate's ``BatchSamplerShard`` gives each process its
    batches of it. ``set_epoch`` is called by Accelerate's ``DataLoaderShard.set_epoch``; it runs in
    the main process, so it works with persistent workers too. ``shard`` ``(index, count)``: every
    ``count``-th sample of the epoch's order from ``index`` on, as many in each shard (replica groups that run
    the same steps: torchft).
    """

    def __init__(self, num_samples: int, seed: int, shuffle: bool = True, shard: tuple[int, int] = (0, 1)):
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self.shard = shard
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator().manual_seed(mix_seed(self.seed, epoch))
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch, (first, count) = self.epoch, self.shard
        return ((epoch, index) for index in self.order(epoch)[first : len(self) * count : count])

    def __len__(self) -> int:
        return self.num_samples // self.shard[1]


class EpochKeyed(Dataset):
    """Adapts a dataset to ``(epoch, index)`` keys: ``sample(index, epoch)`` if it has one, else ``[index]``."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset
        self._sample = getattr(dataset, "sample", None)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        epoch, index = key
        if self._sample is not None:
            return self._sample(index, epoch)
        return self.dataset[index]


# --------------------------------------------------------------------------- loaders


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_num_workers() -> int:
    """Loader workers per process: the CPUs this process may use, less one for the training loop, at most 8."""
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(0, min(8, available_cpus() // local_processes - 1))


def loader_options(num_workers: int, pin_memory: bool, prefetch_factor: int = 4, collate_fn=None) -> dict:
    """Worker processes stay alive across epochs, prefetch, and leave stop signals to the main process; host
    memory is pinned for CUDA copies; ``collate_fn`` (default: torch's) makes a batch of samples, e.g. padded
    to its longest (``transformers.DataCollatorWithPadding``)."""
    options = {"num_workers": num_workers, "pin_memory": pin_memory, "collate_fn": collate_fn}
    if num_workers > 0:
        options.update(persistent_workers=True, prefetch_factor=prefetch_factor, worker_init_fn=ignore_stop_signals)
    return options


def stop_workers(*loaders) -> None:
    """Stop the persistent workers of these loaders (Accelerate-prepared or not) now. They ignore SIGTERM,
    so multiprocessing's exit handler, which terminates them with SIGTERM and then waits for them, would
    wait for good on the workers of a loader still referenced at exit; torch has no public way to stop
    persistent workers (its iterator's own shutdown, used here, runs only when the loader is freed)."""
    for loader in loaders:
        base = getattr(loader, "base_dataloader", loader)
        iterator = getattr(base, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
            base._iterator = None


def train_loader(
    dataset: Dataset, *, batch_size: int, seed: int, shard: tuple[int, int] = (0, 1), **options
) -> DataLoader:
    """Shuffled per epoch, last incomplete batch dropped; prepare it with Accelerate to shard it between processes
    (``shard``: this replica group's share, see :class:`EpochSampler`).
    ``options``: see :func:`loader_options`. Its own generator: each ``iter()`` draws a base seed (for the workers),
    which from the global generator would move every later draw (dropout) after a resume re-creates the iterator."""
    return DataLoader(
        EpochKeyed(dataset),
        batch_size=batch_size,
        sampler=EpochSampler(len(dataset), seed=seed, shuffle=True, shard=shard),
        drop_last=True,
        generator=torch.Generator().manual_seed(mix_seed(seed, 1)),
        **loader_options(**options),
    )


def eval_loader(dataset: Dataset, *, batch_size: int, **options) -> DataLoader:
    """Every sample once, in order; ``gather_for_metrics`` drops the duplicates that padding adds. Its own generator,
    as :func:`train_loader`'s: an evaluation leaves the training's random draws alone."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        drop_last=False,
        generator=torch.Generator(),
        **loader_options(**options),
    )
