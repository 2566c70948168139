"""Hook state comes back from a checkpoint exactly as the hook gave it, or is refused in one line naming the
hook and the key before step 1; hook names are safe file names. Issue 20: items 4 and 10 and the hook-state
tracebacks."""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_tiny_in_process
from safetensors.torch import load_file, save_file

from acceltrain import ConfigError, Hook
from acceltrain.checkpoint.hook_states import check_states, load_states, save_states
from acceltrain.hooks.base import Hooks
from acceltrain.runtime.preemption import EXIT_PREEMPTED

RUN = [
    "--num-train",
    "16",
    "--num-eval",
    "8",
    "--batch-size",
    "4",
    "--epochs",
    "1",
    "--no-progress",
    "--num-workers",
    "0",
    "--report-to",
    "none",
]


class Holds(Hook):
    """A stateful hook whose state is whatever a test gives it; it keeps what it is given back."""

    def __init__(self, state, name="holder"):
        self.state, self.name, self.loaded = state, name, None

    def on_step_end(self, run): ...

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.loaded = state


def described(value):
    """``value`` as nested (type, content) pairs: equal only when types, order, float bits and tensor
    bytes all match, NaN included; tensors that are one object show as the same reference."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), value.contiguous().view(-1).view(torch.uint8).tolist())
    if isinstance(value, dict):
        return (type(value).__name__, [(described(k), described(v)) for k, v in value.items()])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [described(v) for v in value])
    return (type(value).__name__, repr(value))


def round_trip(state, folder: Path):
    """Save ``state`` as a hook's checkpointed state into ``folder`` and load it into a fresh hook."""
    names = save_states(folder, Hooks([Holds(state)]).stateful)
    fresh = Holds(None)
    load_states(folder, Hooks([fresh]).stateful, names)
    return fresh.loaded


t0, t1 = torch.tensor([1.0, 2.0]), torch.tensor([3.0])
EXACT = {
    "dotted keys that collide": {"a.b": t0, "a": {"b": t1}},
    "int keys and tuples": {0: "zero", 1: [1, (2, (3,)), ()], "s": ("x",)},
    "keys of every JSON scalar, tuples of them": {(1, "a"): 1, None: 2, 2.5: 3, True: 4, "1": 5},
    "user dicts that look like the markers": {
        "u": {"__tensor__": "x"},
        "v": {"__tuple__": [1]},
        "w": {"__items__": []},
    },
    "non-finite floats": {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "-0": -0.0, "big": 2**70},
    "tensor dtypes and shapes": {
        "bf16": torch.ones(2, dtype=torch.bfloat16),
        "bool": torch.tensor([True, False]),
        "0-dim": torch.tensor(7),
        "empty": torch.empty(0, 3),
        "nan": torch.tensor([math.nan]),
    },
    "a non-contiguous tensor": {"t": torch.arange(6.0).reshape(2, 3).t()},
    "empty containers": {"d": {}, "l": [], "t": ()},
}


@pytest.mark.parametrize("state", EXACT.values(), ids=EXACT.keys())
def test_hook_state_round_trips_exactly(tmp_path, state):
    """Before: tensors were keyed by their dotted path ({'a.b': t0, 'a': {'b': t1}} gave t1 twice), int keys
    came back as str, tuples as lists, and {'__tensor__': 'x'} was a KeyError on resume."""
    assert described(round_trip(state, tmp_path)) == described(state)


def test_one_tensor_under_two_keys_is_stored_once_and_comes_back_as_one(tmp_path):
    """Before: safetensors refused the shared storage (a RuntimeError blamed on free space)."""
    shared = torch.arange(4.0)
    loaded = round_trip({"a": shared, "b": [shared]}, tmp_path)
    assert torch.equal(loaded["a"], shared) and loaded["a"] is loaded["b"][0]
    assert len(load_file(str(tmp_path / "hooks" / "holder.safetensors"))) == 1


def test_an_ordered_dict_comes_back_as_a_dict_in_order(tmp_path):
    loaded = round_trip(OrderedDict([("z", 1), ("a", torch.ones(1))]), tmp_path)
    assert type(loaded) is dict and list(loaded) == ["z", "a"]


def test_a_checkpoint_written_by_the_previous_format_still_loads(tmp_path):
    """The format before this change: tensors keyed by dotted path, tuples as lists, str keys only."""
    (tmp_path / "hooks").mkdir()
    (tmp_path / "hooks" / "holder.json").write_text(
        json.dumps({"avg": {"w": {"__tensor__": "avg.w"}}, "n": 3, "h": [1, 2]})
    )
    save_file({"avg.w": torch.ones(2)}, str(tmp_path / "hooks" / "holder.safetensors"))
    fresh = Holds(None)
    load_states(tmp_path, Hooks([fresh]).stateful, ["holder"])
    assert described(fresh.loaded) == described({"avg": {"w": torch.ones(2)}, "n": 3, "h": [1, 2]})


def test_a_tampered_state_file_is_a_one_line_error(tmp_path):
    names = save_states(tmp_path, Hooks([Holds({"w": torch.ones(1)})]).stateful)
    (tmp_path / "hooks" / "holder.json").write_text(json.dumps({"w": {"__tensor__": "nope"}, "x": {"__items__": 5}}))
    with pytest.raises(ConfigError, match=r"the state of hook 'holder' is unreadable") as error:
        load_states(tmp_path, Hooks([Holds(None)]).stateful, names)
    assert "\n" not in str(error.value)


class Opaque:
    pass


view_base = torch.arange(4.0)
REFUSED = {
    "numpy array": ({"m": {"x": np.zeros(2)}}, r"\['m'\]\['x'\] is a numpy.ndarray"),
    "numpy scalar": ({"m": [np.float32(1.0)]}, r"\['m'\]\[0\] is a numpy.float32"),
    "numpy float64 (a float subclass)": ({"m": np.float64(1.0)}, r"\['m'\] is a numpy.float64"),
    "set": ({"s": {1, 2}}, r"\['s'\] is a set"),
    "bytes": ({"b": (b"x",)}, r"\['b'\]\[0\] is a bytes"),
    "object": ({"o": Opaque()}, r"\['o'\] is a .*Opaque"),
    "a defaultdict": ({"d": __import__("collections").defaultdict(int)}, r"\['d'\] is a collections.defaultdict"),
    "a tensor as a key": ({"k": {torch.ones(1): 1}}, r"\['k'\] has a key of type torch.Tensor"),
    "a bad key at the top": ({frozenset(): 1}, r"the top level has a key of type frozenset"),
    "a meta tensor": ({"m": torch.empty(2, device="meta")}, r"\['m'\] is on the meta device"),
    "a sparse tensor": ({"w": torch.eye(2).to_sparse()}, r"\['w'\] is a sparse tensor \(torch.sparse_coo\)"),
    "views of one tensor": ({"a": view_base[:2], "b": view_base[2:]}, r"\['b'\] shares memory with \['a'\]"),
    "an unsupported dtype": (
        {"q": torch.zeros(1, dtype=torch.int8).view(torch.quint8)},
        r"\['q'\] has dtype torch.quint8",
    ),
}


@pytest.mark.parametrize(("state", "says"), REFUSED.values(), ids=REFUSED.keys())
def test_state_that_cannot_round_trip_is_refused_in_one_line_naming_hook_and_key(state, says):
    """Before: the start-up check accepted everything and the first save raised a raw TypeError (or a
    RuntimeError/ValueError from safetensors blamed on free space), or the value came back as another type."""
    with pytest.raises(ConfigError, match=rf"^hook 'holder': its state at {says}") as error:
        check_states(Hooks([Holds(state)]).stateful)
    assert "\n" not in str(error.value)


def test_a_state_that_holds_itself_is_refused_in_one_line():
    looped = {}
    looped["me"] = looped
    with pytest.raises(ConfigError, match=r"^hook 'holder': its state is nested too deeply \(or holds itself\)"):
        check_states(Hooks([Holds(looped)]).stateful)


@pytest.mark.parametrize(("state", "kind"), [([1, 2], "list"), (torch.ones(1), "torch.Tensor"), ("x", "str")])
def test_state_dict_must_return_a_dict_or_none(state, kind):
    with pytest.raises(ConfigError, match=rf"^hook 'holder': state_dict\(\) returned a {kind}: return a dict"):
        check_states(Hooks([Holds(state)]).stateful)
    check_states(Hooks([Holds(None)]).stateful)


def test_a_state_that_turns_bad_during_training_is_refused_at_the_save(tmp_path):
    hook = Holds({"ok": 1})
    hooks = Hooks([hook])
    check_states(hooks.stateful)
    hook.state = {"later": {1, 2}}
    with pytest.raises(ConfigError, match=r"^hook 'holder': its state at \['later'\] is a set"):
        save_states(tmp_path, hooks.stateful)
    assert not (tmp_path / "hooks").exists()


BAD_NAMES = [
    "../../../../escape",
    "a/b",
    "a\\b",
    "..",
    ".",
    ".hidden",
    "x\0y",
    "line\nbreak",
    "a" * 101,
    "sp ace",
    "é",
    5,
]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_hook_name_that_is_not_a_safe_file_name_is_refused(name):
    """Before: the name went into the path of hooks/<name>.json as it was, '../' included."""
    with pytest.raises(ConfigError, match=r"^hook name .* is not usable as a file name") as error:
        Hooks([Holds({}, name=name)])
    assert "\n" not in str(error.value) and len(str(error.value)) < 400


def test_two_hook_names_that_differ_only_in_case_are_refused():
    """They would be one file on a case-insensitive file system (macOS, Windows)."""
    with pytest.raises(ConfigError, match=r"two stateful hooks are named 'EMA' and 'ema'"):
        Hooks([Holds({}, name="EMA"), Holds({}, name="ema")])


class MyHook(Hook):
    def on_step_end(self, run): ...


def test_a_hook_class_instead_of_an_instance_is_refused():
    """Before: a TypeError from the first call of one of its methods."""
    with pytest.raises(ConfigError, match=r"^hook MyHook is a class: pass an instance, MyHook\(\)$"):
        Hooks([MyHook])


class Tricky(Hook):
    """Training-time state with every shape that once came back wrong; records what it saved and got back."""

    name = "tricky"

    def __init__(self):
        self.state, self.loaded = None, None

    def on_fit_start(self, run):
        if self.state is None:
            weight = next(run.model.parameters()).detach().clone()
            self.state = {
                "a.b": weight,
                "a": {"b": weight * 2},
                0: ("x", 1),
                "u": {"__tensor__": "x"},
                "same": [weight, weight],
                "nan": math.nan,
            }

    def on_step_end(self, run):
        self.state["a.b"].add_(1)

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state, self.loaded = state, (described(state), state["same"][0] is state["same"][1])


def test_hook_state_survives_a_real_stop_and_resume_exactly(tmp_path):
    out = tmp_path / "run"
    first = Tricky()
    assert run_tiny_in_process(out, *RUN, "--stop-after-steps", "2", hooks=[first]) == EXIT_PREEMPTED
    saved = described(first.state)
    resumed = Tricky()
    assert run_tiny_in_process(out, *RUN, "--resume", "auto", hooks=[resumed]) == 0
    assert resumed.loaded == (saved, True)


class NumpyAtStart(Hook):
    name = "np-hook"

    def on_fit_start(self, run):
        self.value = np.float32(0.5)

    def state_dict(self):
        return {"stats": {"mean": self.value}}


def test_unsaveable_state_stops_the_run_before_step_1_in_one_line(tmp_path, capsys):
    """Before: a raw TypeError at the first save, mid-training, with .tmp-step_N left behind."""
    out = tmp_path / "run"
    assert run_tiny_in_process(out, *RUN, "--save-every-steps", "1", hooks=[NumpyAtStart()]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: hook 'np-hook': its state at ['stats']['mean'] is a numpy.float32"), err
    assert not out.exists(), "nothing is left behind"


def test_a_hook_name_with_dots_and_slashes_writes_nothing_outside_the_checkpoint(tmp_path, capsys):
    out = tmp_path / "a" / "b" / "run"
    assert (
        run_tiny_in_process(out, *RUN, "--stop-after-steps", "1", hooks=[Holds({"x": 1}, name="../../../../escape")])
        == 2
    )
    assert "is not usable as a file name" in capsys.readouterr().err
    assert not list(tmp_path.rglob("escape*")) and not out.exists()
