"""Resuming never runs code from a checkpoint: a pickle planted in any kind of checkpoint file (its
manifest entry rewritten to match, as whoever edits a file can) is refused with one line, and its
payload never runs. DeepSpeed's checkpoint engine, which asks torch.load for weights_only=False, included."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import RECIPE, check, launch, run_tiny_in_process

from acceltrain.checkpoint.files import _sha256, complete_checkpoints
from acceltrain.checkpoint.safe_load import check_loadable_without_code
from acceltrain.checkpoint.state import CheckpointError
from acceltrain.runtime.preemption import EXIT_PREEMPTED

RUN = [
    "--num-train",
    "40",
    "--batch-size",
    "4",
    "--epochs",
    "2",
    "--no-progress",
    "--num-workers",
    "0",
    "--report-to",
    "none",
]


class Payload:
    """Unpickling this creates ``marker``: the proof that loading ran code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def plant(checkpoint: Path, relative: str, marker: Path, plain_pickle: bool = False) -> None:
    """Replace one file with a malicious pickle (torch.save's format, or ``plain_pickle`` as DCP's ``.metadata``)
    and make the manifest agree with it."""
    import pickle

    target = checkpoint / relative
    if plain_pickle:
        target.write_bytes(pickle.dumps(Payload(marker)))
    else:
        torch.save({"state": Payload(marker)}, target)
    manifest = json.loads((checkpoint / "COMPLETE").read_text())
    manifest[relative] = {"bytes": target.stat().st_size, "sha256": _sha256(target)}
    (checkpoint / "COMPLETE").write_text(json.dumps(manifest))


def restore(checkpoint: Path, pristine: dict[str, bytes]) -> None:
    for name, data in pristine.items():
        (checkpoint / name).write_bytes(data)


def run_tiny(output_dir: Path, *args: str) -> int:
    return run_tiny_in_process(output_dir, *RUN, *args)


@pytest.mark.parametrize(
    "relative", ["model.safetensors", "optimizer.bin", "scaler.pt", "random_states_0.pkl", "hooks/EMA.safetensors"]
)
def test_a_planted_pickle_in_a_checkpoint_is_refused_and_never_runs(tmp_path, capsys, relative):
    out, marker = tmp_path / "run", tmp_path / "payload-ran"
    assert run_tiny(out, "--stop-after-steps", "3", "--ema-decay", "0.9") == EXIT_PREEMPTED
    (checkpoint,) = complete_checkpoints(out)
    plant(checkpoint, relative, marker)
    capsys.readouterr()
    assert run_tiny(out, "--resume", "auto", "--ema-decay", "0.9") == 2
    err = capsys.readouterr().err.strip()
    assert relative.split("/")[-1].split(".")[0] in err and "\n" not in err, err
    assert not marker.exists(), "the checkpoint ran code"


@pytest.mark.slow
def test_deepspeed_checkpoint_files_with_a_planted_pickle_are_refused_and_never_run(tmp_path):
    pytest.importorskip("deepspeed")
    args = [
        "--dataset",
        "synthetic",
        "--model",
        "resnet_tiny",
        "--batch-size",
        "16",
        "--max-steps",
        "4",
        "--no-progress",
        "--num-workers",
        "0",
        "--report-to",
        "none",
    ]
    out, marker = tmp_path / "run", tmp_path / "payload-ran"
    stopped = launch(
        RECIPE,
        [*args, "--output-dir", str(out), "--stop-after-steps", "2"],
        launcher="accelerate",
        config="deepspeed_zero2.yaml",
    )
    assert "stopped at step 2" in stopped.stdout, stopped.stderr[-2000:]
    (checkpoint,) = complete_checkpoints(out)
    pristine = {
        name: (checkpoint / name).read_bytes()
        for name in (
            "COMPLETE",
            "pytorch_model/mp_rank_00_model_states.pt",
            "pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt",
        )
    }
    model_states, optim_states = list(pristine)[1:]
    plant(checkpoint, model_states, marker)
    resume = [*args, "--output-dir", str(out), "--resume", "auto"]
    result = launch(RECIPE, resume, launcher="accelerate", config="deepspeed_zero2.yaml")
    assert result.returncode != 0 and "cannot be loaded without running code" in result.stderr, result.stderr[-2000:]
    assert not marker.exists(), f"{model_states}: the checkpoint ran code"
    restore(checkpoint, pristine)
    plant(checkpoint, optim_states, marker)  # the same check, in this process: one DeepSpeed start-up less
    with pytest.raises(CheckpointError, match=f"{optim_states.split('/')[-1]}.* cannot be loaded without running code"):
        check_loadable_without_code(checkpoint)
    assert not marker.exists(), f"{optim_states}: the checkpoint ran code"
    restore(checkpoint, pristine)
    without = launch(RECIPE, resume)  # no DeepSpeed (issue 31, item 2)
    assert without.returncode == 2 and without.stderr.strip().splitlines()[-1] == (
        f"error: checkpoint {str(checkpoint)!r} holds DeepSpeed model and optimizer state and this run is one process: "
        "resume it under DeepSpeed, as it was written (its weights alone: DeepSpeed's zero_to_fp32.py in that folder), "
        "or start a new --output-dir"
    ), without.stderr[-2000:]
    check(launch(RECIPE, resume, launcher="accelerate", config="deepspeed_zero2.yaml"))


def test_deepspeeds_own_load_runs_without_code_too():
    """Defence in depth behind the check: inside loading_without_code, torch.load asked for weights_only=False
    (as DeepSpeed's checkpoint engine does) still refuses a pickle that would run code."""
    import io
    import pickle

    from acceltrain.checkpoint.safe_load import loading_without_code

    buffer = io.BytesIO()
    torch.save({"state": Payload(Path("/nonexistent/never"))}, buffer)
    with loading_without_code(), pytest.raises(pickle.UnpicklingError):
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)


class ByName:
    """Pickles as ``getattr(owner, name)``: how some Python versions (3.11.2 here) pickle an Enum member, e.g.
    the ZeroStageEnum in DeepSpeed's optimizer states; the same opcode could fetch any attribute."""

    def __init__(self, owner, name):
        self.owner, self.name = owner, name

    def __reduce__(self):
        return getattr, (self.owner, self.name)


def _saved(value) -> Path:
    import tempfile

    path = Path(tempfile.mkdtemp()) / "checkpoint"
    path.mkdir()
    torch.save({"state": value}, path / "optimizer.bin")
    return path


def test_an_allowed_enum_pickled_by_name_loads_and_other_attributes_do_not():
    import enum

    from acceltrain.checkpoint.safe_load import allowed_enums, check_loadable_without_code
    from acceltrain.checkpoint.state import CheckpointError

    Stage = next(iter(allowed_enums()), None)
    if Stage is None:
        pytest.skip("no allow-listed enum without DeepSpeed")
    check_loadable_without_code(_saved(ByName(Stage, next(iter(Stage)).name)))  # as DeepSpeed's states on Python 3.11.2
    assert issubclass(Stage, enum.Enum)
    for owner, name in ((Path, "unlink"), (Stage, "__class__"), (Stage, "mro")):
        with pytest.raises(CheckpointError, match="cannot be loaded without running code"):
            check_loadable_without_code(_saved(ByName(owner, name)))


def _sharded(folder: Path, extra=None) -> Path:
    """A torch.distributed.checkpoint folder as FSDP's sharded state dicts are written (``.metadata`` plus
    ``__0_0.distcp``), here on one process without a process group."""
    import torch.distributed.checkpoint as dcp

    state = {
        "model": {"weight": torch.randn(4, 3), "step": torch.tensor(7)},
        "param_groups": [{"lr": 0.1, "nesterov": True}],
    }
    if extra is not None:
        state["extra"] = extra
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder / "pytorch_model_fsdp_0")), no_dist=True)
    return folder


def test_fsdp_sharded_checkpoints_load_and_a_planted_pickle_in_their_metadata_or_items_is_refused(tmp_path):
    """DCP unpickles ``.metadata`` with plain pickle (FSDP's load path), and each non-tensor item of a .distcp
    file with torch.load(weights_only=False): both are checked before the resume."""
    import pickle

    from acceltrain.checkpoint.safe_load import check_loadable_without_code
    from acceltrain.checkpoint.state import CheckpointError

    check_loadable_without_code(_sharded(tmp_path / "clean"))
    marker = tmp_path / "payload-ran"
    planted = _sharded(tmp_path / "metadata")
    (planted / "pytorch_model_fsdp_0" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(
        CheckpointError, match=r"\.metadata' cannot be loaded without running code .*posix.mkdir is not allowed"
    ):
        check_loadable_without_code(planted)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp' cannot be loaded without running code"):
        check_loadable_without_code(_sharded(tmp_path / "item", extra=Payload(marker)))
    assert not marker.exists(), "the checkpoint ran code"


def test_dcp_metadata_with_enum_members_pickled_by_name_loads_and_other_attributes_do_not(tmp_path):
    """Python 3.11.2 pickles DCP's _MEM_FORMAT_ENCODING members as getattr(enum, name): found by CI there."""
    import pickle

    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    from acceltrain.checkpoint.safe_load import load_dcp_metadata as _load_dcp_metadata

    member = next(iter(_MEM_FORMAT_ENCODING))
    (tmp_path / "enum").write_bytes(pickle.dumps(ByName(_MEM_FORMAT_ENCODING, member.name)))
    assert _load_dcp_metadata(tmp_path / "enum") is member
    for owner, name in (
        (type(Path()), "unlink"),
        (_MEM_FORMAT_ENCODING, "__class__"),
    ):  # PosixPath is allowed, its methods are not
        (tmp_path / "other").write_bytes(pickle.dumps(ByName(owner, name)))
        with pytest.raises(pickle.UnpicklingError, match="is not an allowed enum member"):
            _load_dcp_metadata(tmp_path / "other")


def test_dcp_metadata_cannot_rewrite_an_allowed_class_nor_hide_in_a_fallback_file_or_a_linked_folder(tmp_path):
    """Three ways past the first metadata check (found in review): BUILD on an allowed class (here setting
    PosixPath.parent for the whole process), DCP's fallback ``__0.metadata`` when ``.metadata`` is missing,
    and a shard folder behind a symbolic link, which rglob does not walk into."""
    import pickle
    import shutil

    from acceltrain.checkpoint.safe_load import check_loadable_without_code
    from acceltrain.checkpoint.safe_load import load_dcp_metadata as _load_dcp_metadata
    from acceltrain.checkpoint.state import CheckpointError

    (tmp_path / "build").write_bytes(b"cpathlib\nPosixPath\n}X\x06\x00\x00\x00parentX\x06\x00\x00\x00hackedsb.")
    with pytest.raises(pickle.UnpicklingError, match="BUILD on a type is not allowed"):
        _load_dcp_metadata(tmp_path / "build")
    assert Path("/a/b").parent == Path("/a")
    marker = tmp_path / "payload-ran"
    fallback = _sharded(tmp_path / "fallback") / "pytorch_model_fsdp_0"
    (fallback / ".metadata").unlink()
    (fallback / "__0.metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match=r"__0\.metadata' cannot be loaded without running code"):
        check_loadable_without_code(fallback.parent)
    linked = tmp_path / "linked"
    linked.mkdir()
    shutil.move(str(fallback), str(tmp_path / "elsewhere"))
    (linked / "pytorch_model_fsdp_0").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CheckpointError, match=r"holds symbolic links \(pytorch_model_fsdp_0\)"):
        check_loadable_without_code(linked)
    assert not marker.exists(), "the checkpoint ran code"
