"""``--packing``: several examples in one row of at most ``block_size`` tokens, so that a batch spends its compute on
real tokens instead of padding (SFT examples of skewed lengths pad a lot per batch).

The rows are packed once, best-fit-decreasing (:func:`best_fit_decreasing`, TRL's ``packing=True`` strategy), as a
function of the examples' lengths in their order: the loop's (seed, epoch) sampler then shuffles rows as it shuffles
examples, and a resumed run trains the same rows. Each batch is made by Transformers'
``DataCollatorWithFlattening`` row by row (position ids restarting at each example, -100 where one example would
predict the next one's first token), the rows padded on the right as one more sequence of their own; with a
FlashAttention implementation the whole batch is one flattened row with the FlashAttention boundary arguments.

No attention mask goes with packed rows and the cache stays off (:class:`~acceltrain.text.lm.CausalLMTask`):
Transformers builds the block-diagonal mask from the position ids only then, and with a mask or a cache attention
silently crosses examples. A model that cannot take packed rows exactly (no ``position_ids``, a linear-attention or
convolution layer over tokens, a cache forced on) is found by :class:`PackingCheck` before training, by comparing
a packed example's logits with the same example run alone, and refused in one line."""

from __future__ import annotations

import bisect

import torch
from torch.utils.data import Dataset

from acceltrain.config.options import ConfigError, first_line
from acceltrain.hooks.base import Hook
from acceltrain.text.lm import IGNORE_INDEX

__all__ = [
    "PackedBatches",
    "PackedRows",
    "PackingCheck",
    "best_fit_decreasing",
    "check_packable",
    "document_pieces",
    "flash_attention",
    "packed_documents",
]

PROBE_LENGTHS = (7, 9)  # the check's two examples, packed in one row and each run alone


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of example indices whose lengths sum to at most ``capacity``: the longest example first (ties: the
    earlier), each into the bin it fills most (ties: the earliest such bin), a new bin when none has room. A
    function of ``lengths`` alone; bins come in the order they were opened, indices in the order they went in."""
    if any(length > capacity for length in lengths):
        raise ValueError(f"an example of {max(lengths)} tokens is longer than the rows of {capacity}")
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin), sorted: the first with room >= n fills most
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        at = bisect.bisect_left(free, (length, -1))
        if at == len(free):
            bins.append([index])
            bisect.insort(free, (capacity - length, len(bins) - 1))
            continue
        room, number = free.pop(at)
        bins[number].append(index)
        bisect.insort(free, (room - length, number))
    return bins


class PackedRows(Dataset):
    """``examples`` (``input_ids`` and, for SFT, ``labels``; their ``lengths``) packed into rows of at most
    ``block_size`` tokens; each item is its row's examples, as :class:`PackedBatches` takes them."""

    def __init__(self, examples, lengths: list[int], block_size: int):
        self.examples = examples
        self.bins = best_fit_decreasing(list(lengths), block_size)
        self.lengths = [sum(lengths[index] for index in row) for row in self.bins]  # real tokens per row
        self.fingerprint = getattr(examples, "fingerprint", None)  # what a resume compares

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, index: int) -> list[dict]:
        columns = self.examples[self.bins[index]]  # a datasets.Dataset read at a list: {column: [values]}
        return [{key: values[n] for key, values in columns.items()} for n in range(len(self.bins[index]))]

    @property
    def mean_tokens(self) -> float:
        return sum(self.lengths) / len(self.lengths)


class PackedBatches:
    """Packed rows -> ``input_ids``, ``labels`` and ``position_ids`` [rows, longest row] with no attention mask (see
    the module docstring), and ``real_tokens`` (a count, for the real-tokens figures); with ``flash_attention``,
    [1, all tokens] and the FlashAttention boundary arguments."""

    def __init__(self, pad_token_id: int, *, flash_attention: bool = False):
        from transformers import DataCollatorWithFlattening

        self.pad_token_id, self.flash_attention = pad_token_id, flash_attention
        self.flatten = DataCollatorWithFlattening(
            return_position_ids=True, separator_id=IGNORE_INDEX, return_flash_attn_kwargs=flash_attention
        )

    def __call__(self, rows: list[list[dict]]) -> dict:
        if self.flash_attention:
            batch = dict(self.flatten([example for row in rows for example in row]))
            return {**batch, "real_tokens": batch["input_ids"].numel(), "rows": len(rows)}
        flat = [self.flatten(row) for row in rows]
        width = max(part["input_ids"].size(1) for part in flat)
        pad = {"input_ids": self.pad_token_id, "labels": IGNORE_INDEX}
        batch = {}
        for key in ("input_ids", "labels", "position_ids"):
            batch[key] = torch.cat([_padded(part[key], width, pad.get(key)) for part in flat])
        batch["real_tokens"] = sum(part["input_ids"].size(1) for part in flat)
        return batch


def _padded(row: torch.Tensor, width: int, value: int | None) -> torch.Tensor:
    """``row`` [1, n] to [1, width]: ``value``, or for position ids a sequence of its own (0, 1, ...), which the
    block-diagonal mask keeps apart from the examples."""
    missing = width - row.size(1)
    if not missing:
        return row
    tail = torch.arange(missing, dtype=row.dtype) if value is None else torch.full((missing,), value, dtype=row.dtype)
    return torch.cat([row, tail[None]], dim=1)


def document_pieces(rows, end_of_text: int | None, block_size: int) -> list[list[int]]:
    """Tokenised text rows -> documents (a row ending with ``end_of_text`` ends one, as :mod:`.corpus` marks them)
    cut into pieces of at most ``block_size`` tokens, each packed as an example; a piece of one token, which
    predicts nothing, is left out."""
    pieces, document = [], []

    def cut():
        pieces.extend(
            piece
            for start in range(0, len(document), block_size)
            if len(piece := document[start : start + block_size]) > 1
        )

    for ids in rows:
        document.extend(ids)
        if end_of_text is not None and ids and ids[-1] == end_of_text:
            cut()
            document = []
    cut()
    return pieces


def packed_documents(texts, tokenizer, *, block_size: int, eval_fraction: float, seed: int, num_proc=None):
    """(train, eval) :class:`PackedRows` of the text's documents (:func:`document_pieces`): a seeded
    ``eval_fraction`` of the pieces held out, None when it is 0."""
    import datasets

    from acceltrain.text.corpus import token_rows
    from acceltrain.text.tables import hold_out

    rows = token_rows(texts, tokenizer, num_proc=num_proc)
    pieces = document_pieces(rows["input_ids"], tokenizer.eos_token_id, block_size)
    if not pieces:
        raise ConfigError("--packing: the text holds no document of two tokens or more to train on")
    train, held_out = hold_out(
        datasets.Dataset.from_dict({"input_ids": pieces}),
        eval_fraction,
        seed,
        unit="pieces of documents in the text",
        remedy="more text or a smaller --eval-fraction",
    )
    packed = [
        PackedRows(part, [len(ids) for ids in part["input_ids"]], block_size)
        for part in (train, held_out)
        if part is not None
    ]
    return packed[0], (packed[1] if held_out is not None else None)


def flash_attention(model) -> bool:
    """Whether ``model`` attends with a FlashAttention kernel (a whole batch then goes as one flattened row)."""
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None) or ""
    return "flash" in implementation


class PackingCheck(Hook):
    """Before training, on the prepared model: two examples packed in one row must give the logits each gives run
    alone (within ``tolerance`` of the logits' size; looser under mixed precision), or the run stops with one line
    (see the module docstring)."""

    def __init__(self, task, collate_fn: PackedBatches, vocab_size: int):
        self.task, self.collate_fn, self.vocab_size = task, collate_fn, vocab_size

    def on_fit_start(self, run) -> None:
        exact = run.accelerator.mixed_precision == "no" and next(run.model.parameters()).dtype == torch.float32
        check_packable(run.model, self.task, self.collate_fn, self.vocab_size, run.accelerator.device, exact=exact)


def check_packable(model, task, collate_fn: PackedBatches, vocab_size: int, device, *, exact: bool = True) -> float:
    """The largest difference, relative to the logits' size, between two examples packed in one row and each run
    alone through ``task.logits``; a ConfigError naming the model when it is more than rounding."""
    generator = torch.Generator().manual_seed(0)
    examples = [{"input_ids": torch.randint(vocab_size, (n,), generator=generator).tolist()} for n in PROBE_LENGTHS]
    name = type(getattr(model, "module", model)).__name__
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    described = f"{name} ({attention} attention)" if attention else name
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            packed = task.logits(model, _on(collate_fn([examples]), device))[0].float()
            alone = [task.logits(model, _on(collate_fn([[example]]), device))[0].float() for example in examples]
    except TypeError as err:  # a forward without position_ids
        raise ConfigError(
            f"--packing: {described} cannot take packed rows ({first_line(err)}): train without --packing"
        ) from None
    finally:
        model.train(training)
    reference = torch.cat(alone)
    difference = ((packed[: len(reference)] - reference).abs().max() / reference.abs().max().clamp_min(1e-6)).item()
    tolerance = 1e-4 if exact else 3e-2
    if not difference <= tolerance:
        raise ConfigError(
            f"--packing: {described} does not give a packed example its own logits (they differ from the example "
            f"run alone by {difference:.3g} of their size, more than {tolerance:g}): its attention or another layer "
            "crosses example boundaries (a cache forced on, linear attention, a convolution over tokens, no "
            "position_ids): train without --packing"
        )
    return difference


def _on(batch: dict, device) -> dict:
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}
