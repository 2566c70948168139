"""Text: local files or Hub datasets -> a tokenizer (loaded, or a BPE trained here) -> packed blocks, and
Transformers causal LMs with the token-normalised loss."""

from .corpus import (
    TOKENIZER_FILE,
    load_text,
    removed_on_bad_input,
    save_tokenizer,
    show_progress_bars,
    split_blocks,
    token_blocks,
    tokenizer_for_run,
)
from .lm import (
    IGNORE_INDEX,
    MODEL_PRESETS,
    CausalLMTask,
    build_causal_lm,
    flops_per_block,
    load_causal_lm,
    matmul_parameters,
)

__all__ = [
    "IGNORE_INDEX",
    "MODEL_PRESETS",
    "TOKENIZER_FILE",
    "CausalLMTask",
    "build_causal_lm",
    "flops_per_block",
    "load_causal_lm",
    "load_text",
    "matmul_parameters",
    "removed_on_bad_input",
    "save_tokenizer",
    "show_progress_bars",
    "split_blocks",
    "token_blocks",
    "tokenizer_for_run",
]
