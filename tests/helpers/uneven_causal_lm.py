"""The causal-LM recipe with padded-like sequences: each block predicts only its first 1..T-1 targets
(a length derived from its first token), so micro-batches and processes hold very different numbers of
targets. A per-micro-batch mean would then weigh tokens unequally; the token-normalised loss must not."""

import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
import causal_lm  # noqa: E402

from acceltrain import run_recipe  # noqa: E402
from acceltrain.text import IGNORE_INDEX, CausalLMTask  # noqa: E402


class UnevenTargets(CausalLMTask):
    def targets(self, batch) -> torch.Tensor:
        targets = super().targets(batch)
        lengths = 1 + batch["input_ids"][:, :1] % targets.size(1)
        positions = torch.arange(targets.size(1), device=targets.device)
        return targets.masked_fill(positions >= lengths, IGNORE_INDEX)


main = partial(causal_lm.main, task_class=UnevenTargets)

if __name__ == "__main__":
    run_recipe(main, causal_lm.CausalLMConfig)
