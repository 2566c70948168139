"""Tiny pretrained folders and data for the fine-tuning tests, made on the fly: ``save_pretrained`` of a small model
built from its config, next to a tokenizer built here with ``tokenizers`` on a fixed vocabulary. Nothing downloads.

The classification data is learnable in a few steps (the label is which of two word sets dominates) and its
lengths spread from a few words to a few dozen, so padding per batch and grouping by length matter."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

POSITIVE = "good great fine nice love superb happy bright".split()
NEGATIVE = "bad awful poor terrible hate dull sad grim".split()
NEUTRAL = "movie film plot actor scene story music the a and it was".split()
CHAT_TEMPLATE = (  # a ChatML-like template: each message between <|im_start|>role and <|im_end|>
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def review(rng: random.Random, label: str, words: tuple[int, int] = (3, 40)) -> str:
    """A review of ``words`` words, mostly neutral, with its label's words outnumbering the other's."""
    count = rng.randint(*words)
    own, other = (POSITIVE, NEGATIVE) if label == "pos" else (NEGATIVE, POSITIVE)
    picked = [rng.choice(own) for _ in range(max(1, count // 4))] + [rng.choice(other) for _ in range(count // 10)]
    picked += [rng.choice(NEUTRAL) for _ in range(count - len(picked))]
    rng.shuffle(picked)
    return " ".join(picked)


def reviews(count: int, seed: int = 0, labels=("neg", "pos"), words: tuple[int, int] = (3, 40)) -> list[dict]:
    """``count`` rows ``{"text", "label"}``; a third label, when given, is a neutral review labelled so."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        label = labels[index % len(labels)]
        text = (
            review(rng, label, words)
            if label in ("pos", "neg")
            else " ".join(rng.choice(NEUTRAL) for _ in range(rng.randint(*words)))
        )
        rows.append({"text": text, "label": label})
    return rows


def write_rows(path: Path, rows: list[dict]) -> Path:
    """``rows`` as a csv, jsonl, json (a list) or parquet file, by the suffix."""
    if path.suffix == ".csv":
        with path.open("w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _vocabulary(specials: list[str]) -> dict[str, int]:
    """The special tokens, then every word the data uses, sorted: a fixed vocabulary (a trained one comes out in
    another order from one process to the next, and with it another model)."""
    words = sorted({*POSITIVE, *NEGATIVE, *NEUTRAL, "user", "assistant", "system", "question", "answer", "again", ":"})
    return {token: index for index, token in enumerate([*specials, *words])}


def bert_folder(path: Path, *, with_tokenizer: bool = True) -> Path:
    """A 2-layer BERT saved as ``BertForMaskedLM`` (no pooler weights: a classifier built on it gets a new pooler
    and head), with a WordPiece tokenizer that has [PAD], [CLS], [SEP] and [MASK]. No dropout: the loop's data
    loader draws from the global random generator when a resumed run re-creates it, so a model with dropout does
    not resume byte-identically yet (a core issue, reported)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertForMaskedLM, PreTrainedTokenizerFast

    vocabulary = _vocabulary(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    tokenizer = Tokenizer(models.WordPiece(vocabulary, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )
    config = BertConfig(
        vocab_size=len(fast),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        pad_token_id=fast.pad_token_id,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    _seeded(BertForMaskedLM, config).save_pretrained(path)
    if with_tokenizer:
        fast.save_pretrained(path)
    return path


def causal_lm_folder(
    path: Path, *, arch: str = "gpt2", pad_token: bool = False, chat_template: bool = False, positions: int = 256
) -> Path:
    """A 2-layer GPT-2 (or Llama) causal LM of ``positions`` positions with a word-level tokenizer that has
    <|endoftext|> (and, if asked, a pad token and a chat template with <|im_start|> and <|im_end|>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = [
        "<unk>",
        "<|endoftext|>",
        *(["<|pad|>"] if pad_token else []),
        *(["<|im_start|>", "<|im_end|>"] if chat_template else []),
    ]
    tokenizer = Tokenizer(models.WordLevel(_vocabulary(specials), unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        eos_token="<|endoftext|>",
        pad_token="<|pad|>" if pad_token else None,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"] if chat_template else None,
    )
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    eos = fast.eos_token_id
    if arch == "gpt2":
        config = GPT2Config(
            vocab_size=len(fast),
            n_positions=positions,
            n_embd=32,
            n_layer=2,
            n_head=2,
            bos_token_id=eos,
            eos_token_id=eos,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        model = _seeded(GPT2LMHeadModel, config)
    else:
        config = LlamaConfig(
            vocab_size=len(fast),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=positions,
            bos_token_id=eos,
            eos_token_id=eos,
            tie_word_embeddings=True,
        )
        model = _seeded(LlamaForCausalLM, config)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path


def _seeded(model_class, config):
    import torch

    torch.manual_seed(0)
    return model_class(config)


def instructions(count: int, seed: int = 0) -> list[dict]:
    """``{"prompt", "response"}`` rows: the response repeats the prompt's sentiment word, so it is learnable."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        word = rng.choice(POSITIVE + NEGATIVE)
        filler = " ".join(rng.choice(NEUTRAL) for _ in range(rng.randint(1, 12)))
        rows.append({"prompt": f"question: {filler} {word} answer:", "response": f" {word} {word}"})
    return rows


def conversations(count: int, seed: int = 0) -> list[dict]:
    """``{"messages": [...]}`` rows of a user turn and an assistant turn (sometimes two of each)."""
    rows = []
    for index, row in enumerate(instructions(2 * count, seed)[:count]):
        messages = [
            {"role": "user", "content": row["prompt"]},
            {"role": "assistant", "content": row["response"].strip()},
        ]
        if index % 3 == 0:
            messages += [
                {"role": "user", "content": "again"},
                {"role": "assistant", "content": row["response"].strip()},
            ]
        rows.append({"messages": messages})
    return rows
