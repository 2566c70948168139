"""The model presets of ``--model``, without torch or Transformers: the recipe's config class (and so its
``--help`` and its config errors) is built from them before anything heavy is imported."""

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSize:
    layers: int
    width: int
    heads: int


# tiny: ~0.6M non-embedding parameters (tests, CPU); mini: ~11M; small: GPT-2 small (124M with its 50,257 vocabulary)
MODEL_SIZES = {"tiny": ModelSize(3, 128, 4), "mini": ModelSize(6, 384, 6), "small": ModelSize(12, 768, 12)}
ARCHITECTURES = ("gpt2", "llama")
MODEL_PRESETS = tuple(f"{arch}-{size}" for arch in ARCHITECTURES for size in MODEL_SIZES)
