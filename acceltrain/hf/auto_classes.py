"""Which Transformers Auto class loads a model with its head (``BertForSequenceClassification`` ->
``AutoModelForSequenceClassification``), read from Transformers' own mappings: what the run folder's card, the
Hub's pipeline tag, peft's task type and ``acceltrain predict`` are told."""

from __future__ import annotations

# The heads a Transformers architecture may have, in the order they are looked up (a class may sit in several of
# Transformers' mappings): the Auto class that loads it, Transformers' mapping of model types to such classes, and
# the Hub's pipeline tag.
AUTO_CLASSES = (
    ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "text-generation"),
    ("AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "text-classification"),
    ("AutoModelForTokenClassification", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "token-classification"),
    ("AutoModelForQuestionAnswering", "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES", "question-answering"),
    ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "text2text-generation"),
    ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", "fill-mask"),
    ("AutoModelForImageClassification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "image-classification"),
    ("AutoModel", "MODEL_MAPPING_NAMES", "feature-extraction"),
)


def auto_class(config, architecture: str | None = None) -> tuple[str, str] | None:
    """(the Auto class that loads a model of this Transformers config with its head, the Hub pipeline tag), read
    from ``architecture`` (default: ``config.architectures``) and Transformers' own mappings
    (``BertForSequenceClassification`` -> ``AutoModelForSequenceClassification``); None for an architecture no
    Auto class knows."""
    from transformers.models.auto import modeling_auto

    architecture = architecture or (getattr(config, "architectures", None) or [None])[0]
    for name, mapping, pipeline_tag in AUTO_CLASSES:
        classes = getattr(modeling_auto, mapping, {}).get(getattr(config, "model_type", None)) or ()
        if architecture in ((classes,) if isinstance(classes, str) else tuple(classes)):
            return name, pipeline_tag
    return None
