"""The causal language model recipe, from a checkout: the recipe itself is acceltrain/recipes/causal_lm.py
(installed with the package as acceltrain-causal-lm and ``-m acceltrain.recipes.causal_lm``).

    python recipes/causal_lm.py --config recipes/configs/lm_tiny_cpu.yaml \\
        --text-files ../shared/datasets/tinyshakespeare.txt
    python recipes/causal_lm.py --help
"""

from acceltrain.recipes.causal_lm import CausalLMConfig, cli, main

__all__ = ["CausalLMConfig", "cli", "main"]

if __name__ == "__main__":
    cli()
