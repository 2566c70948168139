"""Causal language models for the loop: Transformers models built from a preset (no download) or loaded
from a local folder, and the task that turns token blocks into a token-normalised loss."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from acceltrain.config.options import ConfigError
from acceltrain.text.names import ARCHITECTURES, MODEL_PRESETS, MODEL_SIZES
from acceltrain.train.tasks import Task

IGNORE_INDEX = -100  # a target position that is not predicted (padding, masked tokens)
FLASH_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")  # a flattened batch's boundaries


def build_causal_lm(
    preset: str, *, vocab_size: int, block_size: int, dropout: float = 0.0, end_of_text_id: int | None = None
):
    """A freshly initialised ``<arch>-<size>`` model (see ``MODEL_PRESETS``) for ``vocab_size`` tokens and
    contexts of ``block_size``. Both architectures tie the output projection to the token embedding."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    arch, _, size_name = preset.partition("-")
    if arch not in ARCHITECTURES or size_name not in MODEL_SIZES:
        raise ConfigError(f"--model {preset!r} is invalid: choose one of {', '.join(MODEL_PRESETS)}")
    size = MODEL_SIZES[size_name]
    tokens = {"bos_token_id": end_of_text_id, "eos_token_id": end_of_text_id}
    if arch == "gpt2":
        config = GPT2Config(
            vocab_size=vocab_size,
            n_positions=block_size,
            n_embd=size.width,
            n_layer=size.layers,
            n_head=size.heads,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            **tokens,
        )
    else:
        hidden = 64 * math.ceil(8 * size.width / 3 / 64)  # the SwiGLU width of the Llama papers, rounded up to 64
        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=size.width,
            intermediate_size=hidden,
            num_hidden_layers=size.layers,
            num_attention_heads=size.heads,
            num_key_value_heads=size.heads,
            max_position_embeddings=block_size,
            attention_dropout=dropout,
            tie_word_embeddings=True,
            **tokens,
        )
    return AutoModelForCausalLM.from_config(config)


def load_causal_lm(name_or_path: str, *, vocab_size: int, block_size: int | None):
    """(model, missing keys): a pretrained model from a local folder (or, online, the Hub), checked against the
    tokenizer and the block size (None: not chosen yet, see :func:`~acceltrain.text.pretrained.fitting_length`)
    before any training starts (see :func:`~acceltrain.text.pretrained.load_pretrained`)."""
    from acceltrain.text.pretrained import check_length, embedded_tokens, load_pretrained

    model, missing = load_pretrained("AutoModelForCausalLM", name_or_path)
    embedded = embedded_tokens(model)
    if vocab_size > embedded:
        raise ConfigError(
            f"--model-name-or-path {name_or_path!r} embeds {embedded} tokens but the tokenizer has {vocab_size}: "
            "use the model's own tokenizer (--tokenizer)"
        )
    if block_size is not None:
        check_length(block_size, "--block-size", model, name_or_path)
    return model, missing


def matmul_parameters(model: nn.Module) -> int:
    """Parameters that take part in matrix products: all of them except the input embedding tables
    (token and position lookups cost no FLOPs), with a tied output projection counted once as a matmul."""
    lookups = {
        id(param) for module in model.modules() if isinstance(module, nn.Embedding) for param in module.parameters()
    }
    count = sum(param.numel() for param in model.parameters() if id(param) not in lookups)
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if output is not None and id(output.weight) in lookups:
        count += output.weight.numel()
    return count


def flops_per_block(model: nn.Module, block_size: int) -> int:
    """FLOPs of one forward and backward pass over one block of T = ``block_size`` tokens:
    ``6·N·T + 12·L·d·T²`` (PaLM, appendix B; nanoGPT's MFU), N from :func:`matmul_parameters`, L layers of
    width d. The second term is attention (scores and weighted sum), counted over the full T x T
    square although the causal mask makes half of it unnecessary, as in those references."""
    config = model.config
    return (
        6 * matmul_parameters(model) * block_size + 12 * config.num_hidden_layers * config.hidden_size * block_size**2
    )


class CausalLMTask(Task):
    """Next-token prediction on batches ``{"input_ids": [B, T]}`` (optionally ``"labels"``, -100 where not predicted, as
    SFT leaves the prompt and the padding, and ``"attention_mask"``). Training returns
    ``(summed token loss, target count)`` so that the loop divides the gradient by the targets of the whole accumulation
    window on all processes: the loss of every target token weighs the same however the targets fall across
    micro-batches and processes. Evaluation sums token losses and counts per sequence; ``eval_metrics`` turns the totals
    into the mean token loss and its perplexity."""

    primary_metric = "loss"
    higher_is_better = False
    sums_losses = True

    def __init__(self, block_size: int, flops_per_sample: int):
        self.tokens_per_sample = block_size
        self.flops_per_sample = flops_per_sample
        self.token_tally = TokenTally()

    def targets(self, batch) -> torch.Tensor:
        """The token each position predicts (the next one); override to leave some out with -100."""
        return batch.get("labels", batch["input_ids"])[:, 1:]

    def logits(self, model: nn.Module, batch) -> torch.Tensor:
        """The model's logits for ``batch``, the cache off: packed rows (with ``position_ids``, see
        :mod:`acceltrain.text.packing`) go without an attention mask, as the block-diagonal mask needs; a batch padded
        per batch (SFT) brings its ``attention_mask``."""
        if "position_ids" in batch:
            extra = {key: batch[key] for key in FLASH_KEYS if key in batch}
            return model(
                input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False, **extra
            ).logits
        return model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False).logits

    def token_losses(self, model: nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-position cross-entropy [B, T-1] in float32 (0 where not predicted) and the mask of predicted
        positions."""
        logits = self.logits(model, batch)[:, :-1].float()
        targets = self.targets(batch)
        losses = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
        )
        return losses.view_as(targets), targets != IGNORE_INDEX

    def train_loss(self, model: nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
        self.token_tally.add(batch)
        losses, predicted = self.token_losses(model, batch)
        return losses.sum(), predicted.sum()

    def eval_values(self, model: nn.Module, batch) -> dict[str, torch.Tensor]:
        losses, predicted = self.token_losses(model, batch)
        return {"loss_sum": losses.sum(dim=1), "tokens": predicted.sum(dim=1).float()}

    def eval_metrics(self, sums: dict[str, float], samples: int) -> dict[str, float]:
        loss = sums["loss_sum"] / sums["tokens"]
        return {"loss": loss, "perplexity": math.exp(loss) if loss < 700 else math.inf}


class TokenTally:
    """Real tokens (not padding), row slots and rows of the training batches, since the last log row and in all:
    real tokens/s and the share of real tokens per row come from these, since a padded or packed sample holds an
    unequal number of tokens. Counted on the host from what the collators say (``real_tokens``: no device sync);
    a batch without it is all real tokens (blocks of text)."""

    def __init__(self):
        self.window = {"real": 0, "slots": 0, "rows": 0}
        self.total = dict(self.window)

    def add(self, batch) -> None:
        ids = batch["input_ids"]
        counts = {
            "real": batch.get("real_tokens", ids.numel()),
            "slots": ids.numel(),
            "rows": batch.get("rows", len(ids)),
        }
        for tally in (self.window, self.total):
            for key, count in counts.items():
                tally[key] += int(count)

    def take_window(self) -> dict:
        window, self.window = self.window, {"real": 0, "slots": 0, "rows": 0}
        return window
