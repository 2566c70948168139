"""The hook protocol: optional behaviour as small objects with named methods that the loop calls at fixed
points, so that a feature is a hook and not an edit of ``fit()``.

Events, in the order a run meets them:

- ``on_fit_start(run)``: everything is prepared and a resumed run's state (its hooks' included) restored;
  the first step has not started.
- ``on_epoch_start(run)``: before the first batch of each epoch (of the rest of it, after a resume).
- ``on_step_start(run)``: before the first micro-batch of each optimizer step; ``run.step`` steps are done.
- ``on_before_optimizer_step(run)``: the step's gradients are final: accumulated, synchronised across
  processes, unscaled under fp16 and clipped by ``--max-grad-norm`` (``run.grad_norm``: their norm before
  clipping); ``run.lr`` is this step's learning rate; ``optimizer.step()`` comes next. Under FSDP each
  process holds its shard of them; under DeepSpeed the engine keeps them and has already stepped.
- ``on_step_end(run)``: after each optimizer step (the scheduler stepped, gradients zeroed).
- ``on_epoch_end(run)``: after an epoch's last optimizer step and its ``on_step_end`` (``run.epoch`` is
  the epoch that ends), before the step's save or stop and the next ``on_epoch_start``. Not called for
  an epoch the run leaves early (``--max-steps``, a stop).
- ``on_log(run, metrics)``: a row of metrics is about to be written (metrics.jsonl, trackers, progress
  bar); add entries to ``metrics`` to log them with it.
- ``on_eval_start(run)`` / ``on_eval_end(run, metrics)``: around each evaluation; ``metrics`` may be
  extended; ``run.eval_improved`` says whether the primary metric is the best so far.
- ``on_save(run, folder)``: a checkpoint was published at ``folder`` (with ``--async-checkpoint``, at a later
  step than the one it holds: once every process's files are written).
- ``on_train_end(run)``: training is over (``run.stop`` says why when it ended early), before the final
  checkpoint and weights are written. Called on every ending, a preemption included.
- ``on_fit_end(run, summary)``: the run finished and its weights are written; entries added to
  ``summary`` go into summary.json and the tracker's summary. Not called when the run stops to be
  resumed later.
- ``on_exception(run, error)``: ``fit()`` is raising ``error`` (a divergence, a crash) after
  ``on_fit_start``: give back what ``on_fit_start`` took (signal handlers, files); the error propagates.

At each event your hooks run first, in the order given to ``fit(hooks=[...])``, then the built-in ones in the order of
:func:`acceltrain.hooks.builtin_hooks`; ``on_fit_start`` alone runs the built-in ones first, so that yours may log and
call ``run.evaluate()`` there (a baseline before step 1). Every process calls the same hooks at the same points, so a
hook may use collectives. A hook asks for a checkpoint with ``run.request_save()`` and for an early end with
``run.request_stop(reason, finish=...)``; the loop agrees on the requests across processes once per optimizer step.

A stateful hook returns its state from ``state_dict()``: a dict (or None) of tensors, str, int, float
(NaN and infinities too), bool and None, nested in lists, tuples and dicts whose keys are such scalars
or tuples of them. ``load_state_dict(state)`` gets it back exactly: the same types and keys, one tensor
met twice as one tensor (tensors detached, on the CPU; an OrderedDict as a dict). Anything else (numpy
values, sets, bytes, other objects, sparse tensors, views that share memory) is refused in one line
naming the hook and the key, right after ``on_fit_start``. The state travels in every checkpoint
(tensors as safetensors, the rest as JSON: nothing is unpickled on resume), and resuming with another
set of stateful hooks is refused. Its ``name`` keys that state and names its files (default: the class
name): 1 to 100 ASCII letters, digits, '_', '-' and '.', not starting with '.', distinct ignoring case.
The built-in hooks keep their state the same way (``CheckpointSchedule`` the best checkpoint,
``Trackers`` the W&B run id, ``TimeBudget`` the evaluation's duration); all else a resume needs is the
run's own :class:`~acceltrain.checkpoint.RunState`.
"""

from __future__ import annotations

import re
from pathlib import Path

from acceltrain.config.options import ConfigError, first_line

EVENTS = (
    "on_fit_start",
    "on_epoch_start",
    "on_step_start",
    "on_before_optimizer_step",
    "on_step_end",
    "on_epoch_end",
    "on_log",
    "on_eval_start",
    "on_eval_end",
    "on_save",
    "on_train_end",
    "on_fit_end",
    "on_exception",
)


class Hook:
    """Base class with every method optional: override what you need. Duck typing works too: the loop
    calls whichever of these methods an object has."""

    name: str | None = None

    def on_fit_start(self, run) -> None: ...

    def on_epoch_start(self, run) -> None: ...

    def on_step_start(self, run) -> None: ...

    def on_before_optimizer_step(self, run) -> None: ...

    def on_step_end(self, run) -> None: ...

    def on_epoch_end(self, run) -> None: ...

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


_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")  # portable: no separators, no '..', no hidden file


def _state_name(hook) -> str:
    """A stateful hook's name, which keys its state and names its files hooks/<name>.json and .safetensors."""
    name = hook_name(hook)
    if not (isinstance(name, str) and _FILE_NAME.fullmatch(name)):
        raise ConfigError(
            f"hook name {first_line(repr(name), 120)} is not usable as a file name (its state is saved as "
            "hooks/<name>.json): use 1 to 100 letters, digits, '_', '-' and '.', not starting with '.'"
        )
    return name


class Hooks:
    """The run's hooks in calling order; ``call(event, ...)`` runs the ones that implement ``event``. At
    ``on_fit_start`` the ``builtin`` ones run first (they open the files, trackers and bar that a user's
    ``on_fit_start`` may log to or evaluate into); at every other event the user's ``hooks`` do."""

    def __init__(self, hooks, builtin=()):
        hooks, builtin = list(hooks), list(builtin)
        self.hooks = [*hooks, *builtin]
        for hook in self.hooks:
            if isinstance(hook, type):
                raise ConfigError(f"hook {hook.__name__} is a class: pass an instance, {hook.__name__}()")
            if not any(_implements(hook, event) for event in EVENTS):
                raise ConfigError(f"hook {hook!r} implements none of the hook methods ({', '.join(EVENTS)})")
        self._methods = {event: [getattr(h, event) for h in self.hooks if _implements(h, event)] for event in EVENTS}
        self._methods["on_fit_start"] = [h.on_fit_start for h in [*builtin, *hooks] if _implements(h, "on_fit_start")]
        self.stateful = {}
        for hook in self.hooks:
            if _implements(hook, "state_dict"):
                name = _state_name(hook)
                same = [other for other in self.stateful if other.lower() == name.lower()]  # one file on macOS, Windows
                if same:
                    raise ConfigError(
                        f"two stateful hooks are named {' and '.join(map(repr, [*same, name]))}: give each a distinct "
                        "name (its checkpoint key; case does not count)"
                    )
                self.stateful[name] = hook

    def call(self, event: str, *args) -> None:
        for method in self._methods[event]:
            method(*args)
