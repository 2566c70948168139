"""The hook protocol: optional behaviour as small objects with named methods that the loop calls at fixed
points, so that a feature is a hook and not an edit of ``fit()``.

Events, in the order a run meets them:

- ``on_fit_start(run)``: everything is prepared and a resumed run's state (its hooks' included) restored;
  the first step has not started.
- ``on_epoch_start(run)``: before the first batch of each epoch (of the rest of it, after a resume).
- ``on_step_end(run)``: after each optimizer step (the scheduler stepped, gradients zeroed).
- ``on_log(run, metrics)``: a row of metrics is about to be written (metrics.jsonl, trackers, progress
  bar); add entries to ``metrics`` to log them with it.
- ``on_eval_start(run)`` / ``on_eval_end(run, metrics)``: around each evaluation; ``metrics`` may be
  extended; ``run.eval_improved`` says whether the primary metric is the best so far.
- ``on_save(run, folder)``: a checkpoint was published at ``folder``.
- ``on_train_end(run)``: training is over (``run.stop`` says why when it ended early), before the final
  checkpoint and weights are written. Called on every ending, a preemption included.
- ``on_fit_end(run, summary)``: the run finished and its weights are written; entries added to
  ``summary`` go into summary.json and the tracker's summary. Not called when the run stops to be
  resumed later.
- ``on_exception(run, error)``: ``fit()`` is raising ``error`` (a divergence, a crash) after
  ``on_fit_start``: give back what ``on_fit_start`` took (signal handlers, files); the error propagates.

At each event your hooks run first, in the order given to ``fit(hooks=[...])``, then the built-in ones
in the order of :func:`acceltrain.hooks.builtin_hooks`. Every process calls the same hooks at the same
points, so a hook may use collectives. A hook asks for a checkpoint with ``run.request_save()`` and
for an early end with ``run.request_stop(reason, finish=...)``; the loop agrees on the requests across
processes once per optimizer step.

A stateful hook returns its state from ``state_dict()`` (tensors and JSON values, nested in dicts) and
takes it back in ``load_state_dict(state)``; it travels in every checkpoint (tensors as safetensors,
the rest as JSON: nothing is unpickled on resume), and resuming with another set of stateful hooks
is refused. Its ``name`` keys that state (default: the class name).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError

EVENTS = (
    "on_fit_start", "on_epoch_start", "on_step_end", "on_log", "on_eval_start", "on_eval_end",
    "on_save", "on_train_end", "on_fit_end", "on_exception",
)
HOOKS_DIR = "hooks"  # inside a checkpoint folder: <name>.json and <name>.safetensors per stateful hook


class Hook:
    """Base class with every method optional: override what you need. Duck typing works too: the loop
    calls whichever of these methods an object has."""

    name: str | None = None

    def on_fit_start(self, run) -> None: ...

    def on_epoch_start(self, run) -> None: ...

    def on_step_end(self, run) -> None: ...

    def on_log(self, run, metrics: dict) -> None: ...

    def on_eval_start(self, run) -> None: ...

    def on_eval_end(self, run, metrics: dict) -> None: ...

    def on_save(self, run, folder: Path) -> None: ...

    def on_train_end(self, run) -> None: ...

    def on_fit_end(self, run, summary: dict) -> None: ...

    def on_exception(self, run, error: Exception) -> None: ...

    def state_dict(self) -> dict | None:
        """The state to checkpoint, or None for a stateless hook."""
        return None

    def load_state_dict(self, state: dict) -> None: ...


def _implements(hook, method: str) -> bool:
    """True when ``hook`` has ``method`` and it is not the base class's no-op."""
    bound = getattr(hook, method, None)
    return callable(bound) and getattr(bound, "__func__", None) is not getattr(Hook, method, None)


def hook_name(hook) -> str:
    return getattr(hook, "name", None) or type(hook).__name__


class Hooks:
    """The run's hooks in calling order; ``call(event, ...)`` runs the ones that implement ``event``."""

    def __init__(self, hooks):
        self.hooks = list(hooks)
        for hook in self.hooks:
            if not any(_implements(hook, event) for event in EVENTS):
                raise ConfigError(f"hook {hook!r} implements none of the hook methods ({', '.join(EVENTS)})")
        self._methods = {event: [getattr(h, event) for h in self.hooks if _implements(h, event)] for event in EVENTS}
        self.stateful = {}
        for hook in self.hooks:
            if _implements(hook, "state_dict"):
                name = hook_name(hook)
                if name in self.stateful:
                    raise ConfigError(f"two stateful hooks are named {name!r}: give each a distinct name (its checkpoint key)")
                self.stateful[name] = hook

    def call(self, event: str, *args) -> None:
        for method in self._methods[event]:
            method(*args)

    def check_states(self) -> None:
        """Called by ``fit()`` right after ``on_fit_start``: a state that could not be saved (or not read back
        as it was) is a one-line ConfigError now, not at the first checkpoint."""

    def save_states(self, folder: Path) -> list[str]:
        """Write each stateful hook's state into ``folder/hooks/``; returns their names (for TrainerState)."""
        from safetensors.torch import save_file

        names = []
        for name, hook in self.stateful.items():
            state = hook.state_dict() or {}
            tensors: dict[str, torch.Tensor] = {}
            plain = _split_tensors(state, tensors, prefix="")
            (folder / HOOKS_DIR).mkdir(exist_ok=True)
            (folder / HOOKS_DIR / f"{name}.json").write_text(json.dumps(plain, indent=1, allow_nan=True))
            save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(folder / HOOKS_DIR / f"{name}.safetensors"))
            names.append(name)
        return names

    def load_states(self, folder: Path, saved: list[str]) -> None:
        """Give each stateful hook its state from ``folder``; a different set of hooks is a ConfigError."""
        from safetensors.torch import load_file

        if sorted(saved) != sorted(self.stateful):
            raise ConfigError(
                f"checkpoint {str(folder)!r} holds the state of hooks [{', '.join(sorted(saved))}] but this run has "
                f"stateful hooks [{', '.join(sorted(self.stateful))}]: resume with the same hooks, or start a new --output-dir"
            )
        for name in saved:
            try:
                plain = json.loads((folder / HOOKS_DIR / f"{name}.json").read_text())
                tensors = load_file(str(folder / HOOKS_DIR / f"{name}.safetensors"))
            except Exception as err:  # noqa: BLE001 - OSError, JSONDecodeError, SafetensorError
                raise ConfigError(f"checkpoint {str(folder)!r}: the state of hook {name!r} is unreadable ({str(err)[:200]})") from None
            self.stateful[name].load_state_dict(_join_tensors(plain, tensors))


_TENSOR = "__tensor__"


def _split_tensors(value: Any, tensors: dict, prefix: str) -> Any:
    """``value`` with every tensor replaced by a reference into ``tensors`` (filled here)."""
    if isinstance(value, torch.Tensor):
        tensors[prefix] = value
        return {_TENSOR: prefix}
    if isinstance(value, dict):
        return {str(k): _split_tensors(v, tensors, f"{prefix}.{k}" if prefix else str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_split_tensors(v, tensors, f"{prefix}.{i}") for i, v in enumerate(value)]
    return value


def _join_tensors(value: Any, tensors: dict) -> Any:
    if isinstance(value, dict):
        if set(value) == {_TENSOR}:
            return tensors[value[_TENSOR]]
        return {k: _join_tensors(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_join_tensors(v, tensors) for v in value]
    return value
