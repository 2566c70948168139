"""An exponential moving average of the weights, as a hook: proof that a real feature needs no edit of the loop."""

from __future__ import annotations

import torch

from acceltrain.config.options import ConfigError
from acceltrain.engines import engine_of
from acceltrain.hooks.base import Hook


class EMA(Hook):
    """After every ``every`` optimizer steps: ``average = decay * average + (1 - decay) * weights``, in
    float32, over the model's floating-point parameters and buffers (BatchNorm statistics too; integer
    buffers are copied). ``evaluate``: evaluations run on the averaged weights; ``export``:
    ``model.safetensors`` holds them. The average is checkpointed, so a resumed run continues it exactly.

        fit(cfg, model, optimizer, train_set, eval_set, hooks=[EMA(decay=0.999)])
    """

    def __init__(
        self, decay: float = 0.999, every: int = 1, evaluate: bool = True, export: bool = True, name: str | None = None
    ):
        if not 0 < decay < 1:
            raise ConfigError(f"{type(self).__name__} decay {decay!r} is invalid: must be a number in (0, 1)")
        if every < 1:
            raise ConfigError(f"{type(self).__name__} every {every!r} is invalid: must be an integer >= 1")
        self.decay, self.every, self.evaluate, self.export = decay, every, evaluate, export
        self.name = name
        self.average: dict[str, torch.Tensor] | None = None
        self._restored: dict[str, torch.Tensor] | None = None

    def on_fit_start(self, run) -> None:
        accelerator = run.accelerator
        if not engine_of(accelerator).holds_whole_weights():
            raise ConfigError(
                f"{type(self).__name__} needs every process to hold the full weights: FSDP and DeepSpeed ZeRO-3 "
                "shard them; use DDP or ZeRO-1/2"
            )
        self.live = accelerator.unwrap_model(run.model).state_dict(keep_vars=False)
        source = self._restored if self._restored is not None else self.live
        if set(source) != set(self.live):
            raise ConfigError(
                f"the checkpoint's {type(self).__name__} weights do not match this model's parameters: resume with the "
                "same model"
            )
        self.average = {
            k: source[k].detach().to(self.live[k].device, torch.float32 if v.is_floating_point() else v.dtype).clone()
            for k, v in self.live.items()
        }
        self._floats = [k for k, v in self.live.items() if v.is_floating_point()]
        self._others = [k for k, v in self.live.items() if not v.is_floating_point()]

    @torch.no_grad()
    def on_step_end(self, run) -> None:
        if run.step % self.every:
            return
        torch._foreach_lerp_(
            [self.average[k] for k in self._floats], [self.live[k].float() for k in self._floats], 1 - self.decay
        )
        for key in self._others:
            self.average[key].copy_(self.live[key])

    @torch.no_grad()
    def on_eval_start(self, run) -> None:
        if self.evaluate:
            self._trained = {k: v.clone() for k, v in self.live.items()}
            for key, value in self.live.items():
                value.copy_(self.average[key])

    @torch.no_grad()
    def on_eval_end(self, run, metrics: dict) -> None:
        if self.evaluate:
            for key, value in self.live.items():
                value.copy_(self._trained[key])
            self._trained = None

    def on_train_end(self, run) -> None:
        if self.export:
            run.request_export({k: v.to(self.live[k].dtype) for k, v in self.average.items()})

    def state_dict(self) -> dict:
        return {"decay": self.decay, "average": self.average}

    def load_state_dict(self, state: dict) -> None:
        self._restored = state["average"]
