"""What the text recipes' config classes are built from, without torch or Transformers (so their ``--help`` and
config errors answer before anything heavy is imported): the model presets of ``--model``, and the loop's
settings with defaults for transformers."""

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


def transformer_default(name: str, value):
    """``TrainConfig``'s field ``name`` (same flag, same help) with a default that suits training a transformer: the
    text recipes' config classes redeclare the loop's defaults with it (the loop's suit CIFAR)."""
    import dataclasses

    from acceltrain.config.options import option
    from acceltrain.config.train_config import TrainConfig

    parent = {field.name: field for field in dataclasses.fields(TrainConfig)}[name]
    return option(value, **parent.metadata)
