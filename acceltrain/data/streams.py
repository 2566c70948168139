"""Training on a stream: a ``torch.utils.data.IterableDataset`` (Hugging Face ``load_dataset(...,
streaming=True)`` is one) that need not fit in memory and has no length.

What differs from a sized dataset, and why:

- The run is planned by ``--max-steps``: without a length there are no epochs to count. A pass (an
  epoch) ends when the stream does; the next pass starts it again after ``set_epoch(pass)``, which
  reshuffles a Hugging Face stream's shards and buffer.
- Sharding is Accelerate's ``IterableDatasetShard``: every process reads the stream and trains on its
  slice of each ``batch size x processes`` samples, so no sample is trained on twice or skipped, every
  process ends a pass at the same batch (a stream split by node can end unevenly and hang a
  collective), and 2 processes at batch b train on what 1 process at batch 2b does. Not Accelerate's
  default for streams, ``DataLoaderDispatcher`` (process 0 reads and sends the slices): on Accelerate
  1.16 the position it checkpoints is one of its batches ahead of what was trained, so a resume would
  skip samples.
- Exact resume is torchdata's ``StatefulDataLoader``, through Accelerate's
  ``DataLoaderConfiguration(use_stateful_dataloader=True)``: ``save_state`` records how many batches
  each loader worker has yielded in this pass, and a resume re-reads the pass up to there (the loader's
  fast-forward). The dataset's own ``state_dict()`` is hidden from the loader (:class:`Replayed`): a
  Hugging Face stream's (datasets 5.2) through the loader drops samples with workers and the shuffle
  buffer's content without them (``tests/test_streaming.py`` keeps that measured), and a resume must
  be exact. Re-reading costs the time to read, not to train, the pass so far.
- Accumulation windows run across a pass's end (Accelerate's ``sync_with_dataloader=False``): every
  optimizer step covers ``batch size x processes x grad_accum`` samples, and a pass's end may fall
  inside a window.
"""

from __future__ import annotations

import itertools

import torch
from accelerate.logging import get_logger
from torch.utils.data import DataLoader, IterableDataset

from acceltrain.accelerate_compat import mark_loader_finished
from acceltrain.config.options import ConfigError
from acceltrain.config.train_config import TrainConfig
from acceltrain.data.loaders import loader_options
from acceltrain.runtime.distributed import any_process

logger = get_logger(__name__)


def is_stream(dataset) -> bool:
    return isinstance(dataset, IterableDataset)


def check_stream(cfg: TrainConfig, train_set, eval_set) -> None:
    """What a stream cannot do, one line each, before anything is prepared."""
    name = type(train_set).__name__
    if cfg.max_steps is None:
        raise ConfigError(
            f"the training set is a stream ({name}, an IterableDataset: no length, so no epochs to count): plan the "
            f"run with --max-steps N (with --time-budget-minutes, the most it may train)"
        )
    for flag, on in (("--data-on-device", cfg.data_on_device), ("--auto-batch-size", cfg.auto_batch_size)):
        if on:
            raise ConfigError(f"{flag} needs a sized, indexable training set; {name} is a stream (an IterableDataset)")
    if is_stream(eval_set):
        raise ConfigError(
            f"the eval set is a stream ({type(eval_set).__name__}): evaluation needs a sized one, e.g. its first N "
            "samples in memory (datasets.Dataset.from_list(list(stream.take(N))))"
        )


def first_samples(dataset, count: int) -> list:
    """The first ``count`` samples, indexed or streamed."""
    if is_stream(dataset):
        return list(itertools.islice(iter(dataset), count))
    return [dataset[i] for i in range(min(count, len(dataset)))]


class Replayed(IterableDataset):
    """A stream without its own ``state_dict``, so that the stateful loader resumes it by re-reading (see
    the module docstring); ``set_epoch`` still reaches it."""

    def __init__(self, stream: IterableDataset):
        self.stream = stream

    def __iter__(self):
        return iter(self.stream)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.stream, "set_epoch"):
            self.stream.set_epoch(epoch)


def stream_loader(dataset: IterableDataset, *, batch_size: int, **options) -> DataLoader:
    """Batches of a stream, the last incomplete one of each pass dropped; Accelerate makes it stateful and
    dispatches it. ``options``: see :func:`acceltrain.data.loaders.loader_options`."""
    return DataLoader(
        Replayed(dataset),
        batch_size=batch_size,
        drop_last=True,
        generator=torch.Generator(),  # see train_loader
        **loader_options(**options),
    )


def next_batch(iterator, end, resumed_stream_at: int, epoch: int):
    """The next batch, or ``end`` at the epoch's end. A resumed stream that ends before the checkpoint's place in it
    (``resumed_stream_at`` batches: the loader's fast-forward runs dry) held more data when the checkpoint was
    written."""
    try:
        return next(iterator)
    except StopIteration:
        return end
    except RuntimeError as err:  # "generator raised StopIteration": Accelerate's loader around the fast-forward
        if not (resumed_stream_at and isinstance(err.__cause__, StopIteration)):
            raise
        raise ConfigError(
            f"the training stream ended before the checkpoint's place in it (batch {resumed_stream_at} of pass "
            f"{epoch} on each process): it holds less data than when the checkpoint was written; restore it, or "
            "start a new --output-dir"
        ) from None


def agree_on_pass_end(loader, ended: bool, processes: int, group=None) -> tuple[bool, bool]:
    """(whether the pass ended before this micro-batch, whether it ends with it), the same on every process: once per
    micro-batch on several, so that a stream sharded unevenly (more samples on one process than on another) ends its
    pass everywhere with the first process's end, and no process waits for good in a collective the others never
    reach. ``ended``: this process's loader has no batch left."""
    pass_end = ended or loader.end_of_dataloader
    if processes == 1:
        return ended, pass_end
    missing, pass_end = any_process(ended, pass_end, group=group)
    if pass_end and not loader.end_of_dataloader:  # ended by another process's stream
        mark_loader_finished(loader)  # a checkpoint taken from now on records a finished pass
    return missing, pass_end


def leave_pass(loader, iterator, process: int, epoch: int, batches: int) -> None:
    """End this process's pass ``epoch`` of the stream: as the loader ends it, or, when another process's stream ended
    first (after ``batches``), by leaving the rest untrained (a resume starts the next pass)."""
    if loader.end_of_dataloader:
        next(iterator, None)  # the loader has no batch left: let it finish its pass
        return
    iterator.close()
    loader.end()  # what the closed generator would have done at its end
    logger.warning(
        f"process {process}: pass {epoch} of the training stream ended on another process after {batches} batches; the "
        "rest of this process's pass is left out (the stream holds more samples here than there)",
        main_process_only=False,
    )
