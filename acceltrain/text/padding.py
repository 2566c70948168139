"""Padding per batch: each batch padded to its own longest example by Transformers' collators, for
``fit(collate_fn=...)``, as plain dicts of tensors (a ``BatchEncoding`` is a ``UserDict``, which the loop's
FLOP count does not look into)."""

from __future__ import annotations

import copy

from acceltrain.text.lm import IGNORE_INDEX


class PlainBatches:
    """``collator``'s batches as ``dict``s."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, samples: list) -> dict:
        return dict(self.collator(samples))


class CountedBatches(PlainBatches):
    """``collator``'s batches and ``real_tokens``, the examples' own tokens (padding left out), counted here on the
    host for the real-tokens figures (:class:`~acceltrain.text.lm.TokenTally`)."""

    def __call__(self, samples: list) -> dict:
        return {**super().__call__(samples), "real_tokens": sum(len(sample["input_ids"]) for sample in samples)}


def classification_batches(tokenizer) -> PlainBatches:
    """``input_ids``, ``attention_mask`` (and ``token_type_ids``) padded with the tokenizer's pad token; ``labels``."""
    from transformers import DataCollatorWithPadding

    return PlainBatches(DataCollatorWithPadding(tokenizer))


def sft_batches(tokenizer) -> CountedBatches:
    """``input_ids`` padded on the right with the pad token, ``labels`` with -100 (not predicted), and the
    ``attention_mask``. On the right whatever side the tokenizer pads for generation: a causal LM without
    position ids counts positions from the first column."""
    from transformers import DataCollatorForSeq2Seq

    right = copy.deepcopy(tokenizer)
    right.padding_side = "right"
    return CountedBatches(DataCollatorForSeq2Seq(right, label_pad_token_id=IGNORE_INDEX))


def generation_batches(tokenizer) -> PlainBatches:
    """Prompts padded on the left, as a decoder-only model generates from the last column of each."""
    from transformers import DataCollatorWithPadding

    left = copy.deepcopy(tokenizer)
    left.padding_side = "left"
    return PlainBatches(DataCollatorWithPadding(left))
