"""Recipes run in the test's own process, as ``run_recipe`` runs them, and a hook that records what the trained
model predicts, for comparing a run folder loaded elsewhere with the model that was trained."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from conftest import reset_accelerate_state


def run_in_process(main, config_class, output_dir: Path, *args: str) -> int:
    """The recipe's exit code: 0, 75 when it stopped to be resumed, 2 on bad input."""
    from acceltrain import run_recipe

    reset_accelerate_state()
    try:
        run_recipe(main, config_class, ["--output-dir", str(output_dir), *args])
    except SystemExit as stop:
        return stop.code
    finally:
        reset_accelerate_state()
    return 0


class Predictions:
    """A hook: at the end of the run, the trained model's logits for ``texts`` (tokenised by the run folder's
    tokenizer, padded as one batch), kept in ``logits[output_dir name]``."""

    def __init__(self, texts: list[str]):
        self.texts, self.logits = texts, {}

    def on_fit_end(self, run, summary):
        from transformers import AutoTokenizer

        model = run.accelerator.unwrap_model(run.model).eval()
        batch = AutoTokenizer.from_pretrained(run.output_dir)(self.texts, padding=True, return_tensors="pt")
        with torch.no_grad():
            self.logits[run.output_dir.name] = model(**batch).logits


@contextlib.contextmanager
def recording(hook):
    """``hook`` added to every run's hooks (before the built-in ones) while the context lasts."""
    import pytest

    import acceltrain.train.loop

    builtin = acceltrain.train.loop.builtin_hooks
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(acceltrain.train.loop, "builtin_hooks", lambda cfg, **kwargs: [hook, *builtin(cfg, **kwargs)])
        yield hook
