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

import json
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

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
HOOKS_DIR = "hooks"  # inside a checkpoint folder: <name>.json and <name>.safetensors per stateful hook


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

    def check_states(self) -> None:
        """Called by ``fit()`` right after ``on_fit_start``: a state that could not be saved (or not read back
        as it was) is a one-line ConfigError now, not at the first checkpoint."""
        for name, hook in self.stateful.items():
            _encoded_state(name, hook)

    def save_states(self, folder: Path) -> list[str]:
        """Write each stateful hook's state into ``folder/hooks/``; returns their names (for the RunState).
        Every state is encoded (and so checked) before the first file is written."""
        from safetensors.torch import save_file

        encoded = {name: _encoded_state(name, hook) for name, hook in self.stateful.items()}
        for name, (plain, tensors) in encoded.items():
            (folder / HOOKS_DIR).mkdir(exist_ok=True)
            (folder / HOOKS_DIR / f"{name}.json").write_text(json.dumps(plain, indent=1, allow_nan=True))
            save_file(
                {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
                str(folder / HOOKS_DIR / f"{name}.safetensors"),
            )
        return list(encoded)

    def load_states(self, folder: Path, saved: list[str]) -> None:
        """Give each stateful hook its state from ``folder`` (``saved``: the names there); a different set of hooks
        is a ConfigError."""
        from safetensors.torch import load_file

        held, have = set(saved), set(self.stateful)
        if held != have:
            said = (
                [f"holds the state of hooks [{', '.join(sorted(held - have))}] that this run does not have"]
                if held - have
                else []
            )
            if have - held:
                said.append(f"has no state for this run's stateful hooks [{', '.join(sorted(have - held))}]")
            raise ConfigError(
                f"checkpoint {str(folder)!r} {' and '.join(said)}: resume with the same hooks, or start a new "
                "--output-dir"
            )
        for name in saved:
            try:
                plain = json.loads((folder / HOOKS_DIR / f"{name}.json").read_text())
                state = _decoded(plain, load_file(str(folder / HOOKS_DIR / f"{name}.safetensors")))
            except Exception as err:  # noqa: BLE001 - OSError, JSONDecodeError, SafetensorError, a tampered encoding
                raise ConfigError(
                    f"checkpoint {str(folder)!r}: the state of hook {name!r} is unreadable ({first_line(err, 200)})"
                ) from None
            self.stateful[name].load_state_dict(state)


# A hook's state on disk: JSON, with what JSON lacks as a dict of one marker key. A user dict that has a
# non-str key, or looks like a marker, goes in the items form, so every allowed state comes back as it was.
# Checkpoints written before tensors were keyed by a counter (by dotted path) read the same way.
_TENSOR, _TUPLE, _ITEMS = "__tensor__", "__tuple__", "__items__"
_SCALARS = (str, int, float, bool, type(None))  # exact types: a numpy float64 (a float) would come back as a float
_DICTS = (dict, OrderedDict)  # an OrderedDict (a module's state_dict()) comes back as a dict, in order
_ALLOWED = "tensors, str, int, float, bool, None, and lists, tuples and dicts of them"


def _encoded_state(name: str, hook) -> tuple[Any, dict[str, torch.Tensor]]:
    """``hook``'s state as (JSON value, tensors by key); anything that would not come back as it was is a
    ConfigError naming the hook and the key path."""
    state = hook.state_dict()
    if state is None:
        state = {}
    if type(state) not in _DICTS:
        raise ConfigError(
            f"hook {name!r}: state_dict() returned a {_type_name(state)}: return a dict (or None for no state)"
        )
    encoder = _StateEncoder(name)
    try:
        return encoder.encode(state, ()), encoder.tensors
    except RecursionError:
        raise ConfigError(f"hook {name!r}: its state is nested too deeply (or holds itself)") from None


class _StateEncoder:
    """Tensors are keyed by a counter ("0", "1", ...): dotted paths collide ({"a.b": x, "a": {"b": y}}). One
    tensor met twice is stored once and comes back as one; distinct tensors sharing memory are refused
    (safetensors cannot hold views)."""

    def __init__(self, hook: str):
        self.hook, self.tensors = hook, {}
        self._keys: dict[int, str] = {}  # id(tensor) -> its key; self.tensors keeps the ids alive
        self._memory: dict[tuple, tuple] = {}  # (device, storage address) -> the path of the tensor there
        self._dtypes: set[torch.dtype] = set()

    def refuse(self, path: tuple, why: str) -> ConfigError:
        return ConfigError(f"hook {self.hook!r}: its state at {_shown(path)} {why}")

    def encode(self, value: Any, path: tuple) -> Any:
        """``path``: the keys from the top, formatted only for a refusal (a long list stays cheap)."""
        if type(value) in _SCALARS:  # first: the most common
            return value
        if isinstance(value, torch.Tensor):
            return {_TENSOR: self._tensor_key(value, path)}
        if type(value) in _DICTS:
            return self._dict(value, path)
        if type(value) is list:
            return [self.encode(v, (*path, i)) for i, v in enumerate(value)]
        if type(value) is tuple:
            return {_TUPLE: [self.encode(v, (*path, i)) for i, v in enumerate(value)]}
        raise self.refuse(path, f"is a {_type_name(value)}, which a checkpoint cannot hold: use {_ALLOWED}")

    def _dict(self, value: dict, path: tuple) -> Any:
        if all(type(k) is str for k in value) and not _is_marker(value):
            return {k: self.encode(v, (*path, k)) for k, v in value.items()}
        for key in value:
            if not _is_key(key):
                raise self.refuse(
                    path,
                    f"has a key of type {_type_name(key)}: keys must be str, int, float, bool, None or tuples of them",
                )
        return {_ITEMS: [[self.encode(k, path), self.encode(v, (*path, k))] for k, v in value.items()]}

    def _tensor_key(self, tensor: torch.Tensor, path: tuple) -> str:
        if id(tensor) in self._keys:
            return self._keys[id(tensor)]
        if tensor.layout != torch.strided:
            raise self.refuse(
                path, f"is a sparse tensor ({tensor.layout}): a checkpoint holds dense tensors; save .to_dense()"
            )
        if tensor.is_meta:
            raise self.refuse(path, "is on the meta device (it holds no values): save a materialised tensor")
        self._check_dtype(tensor, path)
        address = tensor.untyped_storage().data_ptr()
        if address and (tensor.device, address) in self._memory:
            raise self.refuse(
                path,
                f"shares memory with {_shown(self._memory[tensor.device, address])} (views of one tensor): save the "
                "tensor they view, or .clone() each",
            )
        self._memory[tensor.device, address] = path
        key = self._keys[id(tensor)] = str(len(self.tensors))
        self.tensors[key] = tensor
        return key

    def _check_dtype(self, tensor: torch.Tensor, path: tuple) -> None:
        """Asks safetensors itself, once per dtype, with an empty view of ``tensor`` (no copy; a 0-dim tensor
        is one value)."""
        from safetensors.torch import save

        if tensor.dtype not in self._dtypes:
            try:
                save({"probe": tensor.detach()[(slice(0, 0),) * tensor.dim()]})
            except Exception:  # noqa: BLE001 - safetensors raises KeyError (or TypeError) for a dtype it lacks
                raise self.refuse(
                    path, f"has dtype {tensor.dtype}, which safetensors cannot store: convert it (e.g. .float())"
                ) from None
            self._dtypes.add(tensor.dtype)


def _shown(path: tuple) -> str:
    """A key path as Python subscripts (['a'][0]), which do not collide as dotted paths do; bounded."""
    return "".join(f"[{key!r}]" for key in path)[:200] or "the top level"


def _is_marker(value: dict) -> bool:
    return len(value) == 1 and next(iter(value)) in (_TENSOR, _TUPLE, _ITEMS)


def _is_key(key: Any) -> bool:
    return type(key) in _SCALARS or (type(key) is tuple and all(map(_is_key, key)))


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _decoded(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The state ``_StateEncoder`` encoded; a reference to one tensor key gives the one loaded tensor."""
    if type(value) is list:
        return [_decoded(v, tensors) for v in value]
    if type(value) is not dict:
        return value
    if not _is_marker(value):
        return {k: _decoded(v, tensors) for k, v in value.items()}
    ((marker, inner),) = value.items()
    if marker == _TENSOR:
        return tensors[inner]
    if marker == _TUPLE:
        return tuple(_decoded(v, tensors) for v in inner)
    return {_decoded(k, tensors): _decoded(v, tensors) for k, v in inner}
