"""The Hugging Face side: the Hub, model cards, auto classes, LoRA adapters."""
