"""The text classification recipe, from a checkout: the recipe itself is acceltrain/recipes/text_classification.py
(installed with the package as acceltrain-text-classification and ``-m acceltrain.recipes.text_classification``).

    python recipes/text_classification.py --config recipes/configs/text_classification_cpu.yaml \
        --model-name-or-path path/to/bert --train-file train.csv --eval-file test.csv
    python recipes/text_classification.py --help
"""

from acceltrain.recipes.text_classification import TextClassificationConfig, cli, main

__all__ = ["TextClassificationConfig", "cli", "main"]

if __name__ == "__main__":
    cli()
