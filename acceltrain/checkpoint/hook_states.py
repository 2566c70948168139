"""The hooks' states in a checkpoint: each stateful hook's ``state_dict()`` as JSON beside a safetensors file of its
tensors (nothing is unpickled on resume), under ``hooks/<name>``; checked when the run starts, so that a state that
could not be saved, or not read back as it was, is one line then and not at the first checkpoint. What a hook's state
may hold is in :mod:`acceltrain.hooks.base`."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from acceltrain.config.options import ConfigError, first_line

HOOKS_DIR = "hooks"  # inside a checkpoint folder: <name>.json and <name>.safetensors per stateful hook


def check_states(stateful: dict) -> None:
    """Encode each hook's state once, writing nothing: a ConfigError for one that could not be saved as it is."""
    for name, hook in stateful.items():
        _encoded_state(name, hook)


def save_states(folder: Path, stateful: dict) -> list[str]:
    """Write each stateful hook's state into ``folder/hooks/``; returns their names (for the RunState). Every state
    is encoded (and so checked) before the first file is written."""
    from safetensors.torch import save_file

    encoded = {name: _encoded_state(name, hook) for name, hook in stateful.items()}
    for name, (plain, tensors) in encoded.items():
        (folder / HOOKS_DIR).mkdir(exist_ok=True)
        (folder / HOOKS_DIR / f"{name}.json").write_text(json.dumps(plain, indent=1, allow_nan=True))
        save_file(
            {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
            str(folder / HOOKS_DIR / f"{name}.safetensors"),
        )
    return list(encoded)


def load_states(folder: Path, stateful: dict, saved: list[str]) -> None:
    """Give each stateful hook its state from ``folder`` (``saved``: the names there); a different set of hooks is a
    ConfigError."""
    from safetensors.torch import load_file

    held, have = set(saved), set(stateful)
    if held != have:
        said = (
            [f"holds the state of hooks [{', '.join(sorted(held - have))}] that this run does not have"]
            if held - have
            else []
        )
        if have - held:
            said.append(f"has no state for this run's stateful hooks [{', '.join(sorted(have - held))}]")
        raise ConfigError(
            f"checkpoint {str(folder)!r} {' and '.join(said)}: resume with the same hooks, or start a new --output-dir"
        )
    for name in saved:
        try:
            plain = json.loads((folder / HOOKS_DIR / f"{name}.json").read_text())
            state = _decoded(plain, load_file(str(folder / HOOKS_DIR / f"{name}.safetensors")))
        except Exception as err:  # noqa: BLE001 - OSError, JSONDecodeError, SafetensorError, a tampered encoding
            raise ConfigError(
                f"checkpoint {str(folder)!r}: the state of hook {name!r} is unreadable ({first_line(err, 200)})"
            ) from None
        stateful[name].load_state_dict(state)


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
