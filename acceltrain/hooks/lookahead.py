"""airbench94's lookahead: the weights pulled back to their own moving average during training."""

from __future__ import annotations

import torch

from acceltrain.engines import engine_of
from acceltrain.hooks.ema import EMA


class Lookahead(EMA):
    """Every ``every`` optimizer steps the average moves towards the weights and the weights are set to the
    average, so training goes on from the smoothed point (Keller Jordan's airbench94, arXiv 2404.00498:
    part of its 94% in 10 epochs). The decay of an update is ``decay ** every * progress ** 3``, with
    ``progress`` the run's fraction done (by steps, or by ``--time-budget-minutes``): no smoothing early,
    strong smoothing late, while the lr decays. The run's last step updates too, so the final evaluation
    and the exported weights are the average. Checkpointed like :class:`EMA`, so a resume is exact.

        fit(cfg, model, optimizer, train_set, eval_set, hooks=[Lookahead(decay=0.95, every=5)])
    """

    def __init__(self, decay: float = 0.95, every: int = 5, name: str | None = None):
        super().__init__(decay=decay, every=every, evaluate=False, export=False, name=name)
        self.updated_step = None

    def on_fit_start(self, run) -> None:
        engine_of(run.accelerator).refuse_setting("lookahead")
        super().on_fit_start(run)

    def on_step_end(self, run) -> None:
        if run.step % self.every == 0 or run.step == run.total_steps:
            self._update(run)

    def on_train_end(self, run) -> None:
        """A run finishing early (a time budget, a target) ends on the average too; when it was already
        evaluated at this step, that is evaluated again, so the final metrics are the exported weights'."""
        finishing = run.stop is None or run.stop.finish
        if finishing and self.updated_step != run.step:
            self._update(run)
            if run.last_eval_step == run.step:
                run.evaluate()

    @torch.no_grad()
    def _update(self, run) -> None:
        progress = min(1.0, max(run.schedule_progress.time_fraction, run.step / run.total_steps))
        decay = self.decay**self.every * progress**3
        torch._foreach_lerp_(
            [self.average[k] for k in self._floats], [self.live[k].float() for k in self._floats], 1 - decay
        )
        for key in self._floats:
            self.live[key].copy_(self.average[key])
        self.updated_step = run.step
