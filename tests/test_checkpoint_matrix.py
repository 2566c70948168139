"""The checkpoint matrix (issue 36): every engine the toolkit offers on CPU x writer x model x stop. Each combination
stops, resumes with ``--resume auto``, and ends on the bytes of the uninterrupted synchronous run of the same engine
and model; a combination that cannot work is refused in one line, itself asserted.

- engines: 1 process, DDP (``multi_cpu.yaml``), FSDP2 (``fsdp_cpu.yaml``), DeepSpeed ZeRO-2 (1 process: sync only);
- writers: synchronous, ``--async-checkpoint``;
- models (tests/helpers/matrix_recipe.py): a BatchNorm CNN, a GPT-2 with tied embeddings, a LoRA adapter;
- stops: ``--stop-after-steps``, SIGTERM, SIGKILL inside a save.

Every engine x writer pair runs in the default suite, each with one model and one stop (rotated so that every model and
every stop meets several engines); the other 53 are the ``sweep`` tier (``pytest -m sweep``, outside the full suite).
The references are module fixtures, one launch per engine and model, shared by all the cases that need
them."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest
from conftest import REPO, check, launch

from acceltrain.checkpoint.files import COMPLETE_FILE, complete_checkpoints
from acceltrain.engines import DDP, FSDP2, DeepSpeed, OneProcess, TorchFT
from acceltrain.engines import ENGINES as REGISTERED_ENGINES
from acceltrain.runtime.preemption import EXIT_PREEMPTED

sys.path.insert(0, str(REPO / "tests" / "helpers"))
from pretrained_folders import bert_folder  # noqa: E402

MATRIX_RECIPE = REPO / "tests" / "helpers" / "matrix_recipe.py"
LAUNCHES = {  # how each registered engine is launched on CPU: a new engine without its line here fails below
    OneProcess: ("one", {}),
    DDP: ("ddp", {"processes": 2, "launcher": "accelerate", "config": "multi_cpu.yaml"}),
    FSDP2: ("fsdp", {"processes": 2, "launcher": "accelerate", "config": "fsdp_cpu.yaml"}),
    DeepSpeed: ("deepspeed", {"processes": 1, "launcher": "accelerate", "config": "deepspeed_zero2.yaml"}),
    TorchFT: ("torchft", {"processes": 2, "launcher": "ft"}),
}
ENGINES = {LAUNCHES[engine][0]: LAUNCHES[engine][1] for engine in REGISTERED_ENGINES}  # the registry's engine axis
STEPS = 8
RUN = [
    "--max-steps",
    str(STEPS),
    "--batch-size",
    "4",
    "--lr",
    "0.05",
    "--save-every-steps",
    "2",
    "--log-every",
    "1",
    "--no-progress",
    "--num-workers",
    "0",
    "--report-to",
    "none",
]
STOPS = {  # the launch that stops, and the complete checkpoint it leaves to resume from
    "stop_after_steps": (["--stop-after-steps", "4"], "step_00000004"),
    "sigterm": (["--sigterm-at", "3"], "step_00000003"),  # saved at the next step boundary, off the save schedule
    "sigkill_mid_save": (["--die-mid-save", "6"], "step_00000004"),
}
# One case per engine x writer pair in the default suite: (engine, writer, model, stop)
DEFAULT = [
    ("one", "sync", "lora", "sigterm"),
    ("one", "async", "lm", "stop_after_steps"),  # tied weights written once (a second name did not resume)
    ("ddp", "sync", "lm", "sigkill_mid_save"),
    ("ddp", "async", "lora", "sigkill_mid_save"),  # the plain module's names (DDP's module. prefix did not resume)
    ("fsdp", "sync", "cnn", "stop_after_steps"),  # BatchNorm statistics rank 0's on every process
    ("fsdp", "async", "lm", "sigterm"),  # a save at every 2nd step and one off schedule (shared DCP plans failed)
    ("deepspeed", "sync", "cnn", "sigterm"),
    ("torchft", "sync", "cnn", "stop_after_steps"),  # every replica group stops; replica 0's checkpoint resumes both
]
REFUSED = {  # combinations that cannot work, and their one line (the engine's own)
    (LAUNCHES[engine][0], key): engine.refusals[setting]
    for engine in REGISTERED_ENGINES
    for key, setting in (("async", "async_checkpoint"), ("lora", "lora"))
    if setting in engine.refusals
}


def test_every_registered_engine_has_its_launch_in_the_matrix():
    assert set(LAUNCHES) == set(REGISTERED_ENGINES)
    assert set(REFUSED) == {("deepspeed", "async"), ("deepspeed", "lora"), ("torchft", "async")}


def _cases():
    for engine, writer, model, stop in itertools.product(ENGINES, ("sync", "async"), ("cnn", "lm", "lora"), STOPS):
        if (engine, writer) in REFUSED or (engine, model) in REFUSED:
            continue
        marks = () if (engine, writer, model, stop) in DEFAULT else (pytest.mark.slow, pytest.mark.sweep)
        yield pytest.param(engine, writer, model, stop, marks=marks, id=f"{engine}-{writer}-{model}-{stop}")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The LoRA runs' pretrained folder: a 2-layer BERT, made here."""
    return bert_folder(tmp_path_factory.mktemp("matrix-base") / "bert", with_tokenizer=False)


def _matrix(engine: str, model: str, base: Path, out: Path, *extra: str):
    args = [
        *RUN,
        "--kind",
        model,
        "--output-dir",
        str(out),
        *(["--base", str(base), "--lora-r", "4"] if model == "lora" else []),
        *extra,
    ]
    return launch(MATRIX_RECIPE, args, timeout=600, **ENGINES[engine])


@pytest.fixture(scope="module")
def reference(base, tmp_path_factory):
    """The uninterrupted synchronous run of an engine and model, launched once when first asked for."""
    root, done = tmp_path_factory.mktemp("matrix-reference"), {}

    def get(engine: str, model: str) -> Path:
        if (engine, model) not in done:
            out = root / f"{engine}-{model}"
            check(_matrix(engine, model, base, out))
            done[engine, model] = out
        return done[engine, model]

    return get


def _weights(out: Path) -> bytes:
    adapter = out / "adapter_model.safetensors"
    return (adapter if adapter.is_file() else out / "model.safetensors").read_bytes()


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(("engine", "writer", "model", "stop"), list(_cases()))
def test_every_stop_resumes_to_the_bytes_of_the_uninterrupted_run(
    engine, writer, model, stop, base, reference, tmp_path
):
    out = tmp_path / "run"
    flags = ["--async-checkpoint"] if writer == "async" else []
    stop_flags, resumes_from = STOPS[stop]
    stopped = _matrix(engine, model, base, out, *flags, *stop_flags)
    if stop == "sigkill_mid_save":
        assert stopped.returncode != 0
        assert (out / "checkpoints" / ".tmp-step_00000006").is_dir(), "killed inside the save of step 6"
        assert not (out / "checkpoints" / ".tmp-step_00000006" / COMPLETE_FILE).exists()
    else:
        assert stopped.returncode in (EXIT_PREEMPTED, 1), stopped.stderr[-2000:]  # 1: torchrun reports a worker's 75 so
        assert "stopped at step" in stopped.stdout + stopped.stderr
    assert complete_checkpoints(out)[-1].name == resumes_from
    check(_matrix(engine, model, base, out, *flags, "--resume", "auto"))
    uninterrupted = reference(engine, model)
    assert _weights(out) == _weights(uninterrupted), (
        f"{engine} {writer} {model} {stop}: not the uninterrupted bytes; resumed {_trace(out)}; uninterrupted "
        f"{_trace(uninterrupted)}"
    )


def _trace(out: Path) -> dict:
    """What a failed comparison needs to be read: skipped steps, and under torchft each launch's quorums."""
    summary = json.loads((out / "summary.json").read_text())
    events = out / "ft_events.jsonl"
    quorums = [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []
    return {
        "skipped_steps": summary.get("skipped_steps"),
        "quorums": [(e["replica"], e["step"], e["participants"]) for e in quorums if e["event"] == "quorum"],
    }


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(("engine", "writer", "model"), [("deepspeed", "async", "cnn"), ("deepspeed", "sync", "lora")])
def test_what_cannot_work_is_refused_in_one_line(engine, writer, model, base, tmp_path):
    result = _matrix(engine, model, base, tmp_path / "run", *(["--async-checkpoint"] if writer == "async" else []))
    expected = REFUSED[engine, writer] if writer == "async" else REFUSED[engine, model]
    assert result.returncode != 0 and expected in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "run").exists(), "nothing is left behind"
