"""Text: local files or Hub datasets -> a tokenizer (loaded, or a BPE trained here) -> packed blocks, and
Transformers causal LMs with the token-normalised loss; fine-tuning a pretrained model: labelled rows for a
sequence classifier, prompt/response or chat rows for supervised fine-tuning, padded per batch. Names are
imported on first use (see ``acceltrain.lazy_exports``)."""

from ..lazy_exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "MODEL_PRESETS": "names", "transformer_default": "names",
    "TOKENIZER_FILE": "corpus", "load_text": "corpus", "save_tokenizer": "corpus",
    "show_progress_bars": "corpus", "split_blocks": "corpus", "expand_text_files": "corpus", "text_fingerprint": "fingerprint",
    "held_out_lines": "corpus", "streamed_blocks": "corpus", "token_blocks": "corpus", "tokenizer_for_run": "corpus",
    "IGNORE_INDEX": "lm", "CausalLMTask": "lm", "build_causal_lm": "lm", "flops_per_block": "lm", "load_causal_lm": "lm",
    "matmul_parameters": "lm",
    "check_columns": "tables", "file_fingerprint": "fingerprint", "hold_out": "tables", "load_rows": "tables", "load_table": "tables",
    "check_vocabulary": "pretrained", "fitting_length": "pretrained", "load_pretrained": "pretrained",
    "pretrained_tokenizer": "pretrained",
    "Labels": "classification_data", "check_texts": "classification_data",
    "encode_classification": "classification_data",
    "classification_examples": "classification_data", "read_labels": "classification_data",
    "TextClassificationTask": "classification", "balanced_class_weights": "classification",
    "per_class": "classification",
    "ClassificationReport": "classification_report",
    "DataReport": "data_report",
    "LengthGrouped": "length_grouping", "first_epoch_padding": "length_grouping",
    "sft_examples": "sft", "sft_kept": "sft",
    "classification_batches": "padding", "generation_batches": "padding", "sft_batches": "padding",
})
