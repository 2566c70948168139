"""FSDP2 on CPU processes (issue 32): accelerate_configs/fsdp_cpu.yaml shards any recipe for real (DTensor
parameters, half of each sharded tensor per process), trains the same maths as DDP and as one process at
twice the batch (clipping and accumulation included; the LM's token-normalised loss too), resumes
byte-identically from DCP shards inside the toolkit's atomic checkpoints (stopped, SIGTERMed or killed mid-save,
synchronous and async: tests/test_checkpoint_matrix.py), and continues on another process count through DCP's
resharding. Each launch starts 2 gloo processes: the runs are shared by module fixtures."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY_RECIPE, check, launch, read_summary, subprocess_env
from safetensors.torch import load_file

from acceltrain.checkpoint.files import complete_checkpoints, verify_checkpoint
from acceltrain.checkpoint.state import CheckpointError
from acceltrain.commands.cli import main

pytestmark = pytest.mark.multiprocess

# 2 processes x batch 4 x 2 micro-batches = 16 samples per optimizer step; clipped, so the gradient norm must be global
TINY = [
    "--num-train",
    "96",
    "--grad-accum",
    "2",
    "--max-steps",
    "6",
    "--max-grad-norm",
    "0.5",
    "--lr",
    "0.05",
    "--no-progress",
    "--num-workers",
    "0",
    "--report-to",
    "none",
    "--log-every",
    "1",
    "--save-every-steps",
    "3",
]
FSDP = {"launcher": "accelerate", "config": "fsdp_cpu.yaml"}


def fsdp(args: list[str], processes: int = 2) -> subprocess.CompletedProcess:
    return launch(TINY_RECIPE, args, processes=processes, **FSDP)


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model.safetensors"))


def assert_close(got: Path, expected: Path, rtol: float = 1e-5) -> None:
    reference = weights(expected)
    for key, value in weights(got).items():
        torch.testing.assert_close(value, reference[key], rtol=rtol, atol=1e-7, msg=key)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The same 6 SGD steps under FSDP (2 processes), DDP (2 processes) and on one process at twice the batch."""
    root = tmp_path_factory.mktemp("fsdp")
    out = {name: root / name for name in ("fsdp", "ddp", "single")}
    check(fsdp([*TINY, "--batch-size", "4", "--output-dir", str(out["fsdp"])]))
    check(
        launch(
            TINY_RECIPE,
            [*TINY, "--batch-size", "4", "--output-dir", str(out["ddp"])],
            processes=2,
            launcher="accelerate",
        )
    )
    check(launch(TINY_RECIPE, [*TINY, "--batch-size", "8", "--output-dir", str(out["single"])]))
    return out


@pytest.mark.slow
def test_fsdp_on_cpu_processes_shards_for_real_and_trains_as_ddp_and_one_process(runs):
    summary = read_summary(runs["fsdp"])
    assert (summary["distributed_type"], summary["num_processes"]) == ("FSDP", 2)
    runtime = summary["runtime"]
    assert runtime["parameters_per_process"] < 0.6 * runtime["parameters"], (
        "each process holds about half of each tensor"
    )
    assert read_summary(runs["ddp"])["runtime"]["parameters_per_process"] == runtime["parameters"]
    assert_close(runs["fsdp"], runs["ddp"])
    assert_close(runs["fsdp"], runs["single"])


def test_no_process_group_outlives_an_fsdp_or_ddp_run(runs):
    """Issue 43 item 6: after an FSDP2 run each rank still had the destroyed group's 3 gloo threads (FSDP2's mesh
    info and DeviceMesh, which the model holds, kept the group), and a rank that exited so while its peer still ran
    sometimes aborted ("terminate called without an active exception"): the launcher exited 1 after the run had
    finished. Each rank records its gloo threads once fit() has returned, with its model still referenced."""
    for name in ("fsdp", "ddp"):
        for rank in (0, 1):
            recorded = json.loads((runs[name] / f"rank{rank}.json").read_text())
            assert recorded["gloo_threads_after_fit"] == [], (name, rank)


def continue_from(checkpoint: Path, out: Path) -> None:
    """``out`` holds only a copy of ``checkpoint``, as a folder preempted at that step would."""
    shutil.copytree(checkpoint, out / "checkpoints" / checkpoint.name)


@pytest.mark.slow
def test_an_fsdp_checkpoint_continues_on_one_process_and_back_on_two(tmp_path, runs):
    """DCP reshards on load, optimizer state included: 2 -> 1 (batch 8) and 1 -> 2 (batch 4) processes, each
    within float rounding of the run never stopped."""
    two_to_one = tmp_path / "two-to-one"
    continue_from(complete_checkpoints(runs["fsdp"])[0], two_to_one)
    check(fsdp([*TINY, "--batch-size", "8", "--output-dir", str(two_to_one), "--resume", "auto"], processes=1))
    assert read_summary(two_to_one)["resumed_from_step"] == 3
    assert_close(two_to_one, runs["fsdp"])

    one_to_two = tmp_path / "one-to-two"
    fsdp([*TINY, "--batch-size", "8", "--output-dir", str(one_to_two), "--stop-after-steps", "3"], processes=1)
    check(fsdp([*TINY, "--batch-size", "4", "--output-dir", str(one_to_two), "--resume", "auto"]))
    assert_close(one_to_two, runs["fsdp"])


@pytest.mark.slow
def test_a_missing_or_altered_shard_is_refused(tmp_path, runs):
    for damage in ("delete", "alter"):
        copy = tmp_path / damage
        shutil.copytree(complete_checkpoints(runs["fsdp"])[0], copy)
        shard = copy / "optimizer_0" / "__1_0.distcp"
        if damage == "delete":
            shard.unlink()
        else:
            data = shard.read_bytes()
            shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
        with pytest.raises(CheckpointError, match="is missing" if damage == "delete" else "is corrupted"):
            verify_checkpoint(copy)


def rewrite_manifest(checkpoint: Path) -> None:
    """A manifest that agrees with the files as they are now: what a tool that 'repairs' checkpoints writes."""
    import hashlib

    files = sorted(p for p in checkpoint.rglob("*") if p.is_file() and p.name != "COMPLETE")
    manifest = {
        str(p.relative_to(checkpoint)): {
            "bytes": p.stat().st_size,
            "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
        }
        for p in files
    }
    (checkpoint / "COMPLETE").write_text(json.dumps(manifest))


def test_shard_files_swapped_between_processes_are_refused_though_the_manifest_agrees(tmp_path, runs):
    """Issue 36 item 7: DCP reads an item by file name and offset alone, so rank 0's and rank 1's shard files swapped
    (under a rewritten manifest) resumed silently into another model; each item's recorded sha256 catches it."""
    from acceltrain.checkpoint.safe_load import check_loadable_without_code

    copy = tmp_path / "swapped"
    shutil.copytree(complete_checkpoints(runs["fsdp"])[0], copy)
    shards = copy / "pytorch_model_fsdp_0"
    (shards / "__0_0.distcp").rename(shards / "swap")
    (shards / "__1_0.distcp").rename(shards / "__0_0.distcp")
    (shards / "swap").rename(shards / "__1_0.distcp")
    rewrite_manifest(copy)
    verify_checkpoint(copy)  # the manifest agrees: it cannot tell
    with pytest.raises(
        CheckpointError, match=r"__[01]_0\.distcp' does not hold what its DCP metadata says at \d+ \(model\."
    ):
        check_loadable_without_code(copy, digests_required=True)
    (copy / "shard_digests.json").unlink()
    rewrite_manifest(copy)
    with pytest.raises(CheckpointError, match="holds DCP shards without shard_digests.json"):
        check_loadable_without_code(copy, digests_required=True)


@pytest.mark.slow
def test_batchnorm_trains_as_under_ddp_and_runs_under_bf16(tmp_path):
    """Issue 36 items 5 and 6: the running statistics are rank 0's on every process after each training forward, as
    DDP makes them (they were each process's own, and a resume took one process's for all): the same bytes as DDP.
    Under bf16 a BatchNorm model stopped at the first step (a bf16 weight beside fp32 statistics)."""
    args = [*TINY, "--batch-size", "4", "--batchnorm"]
    check(fsdp([*args, "--output-dir", str(tmp_path / "fsdp")]))
    check(launch(TINY_RECIPE, [*args, "--output-dir", str(tmp_path / "ddp")], processes=2, launcher="accelerate"))
    assert (tmp_path / "fsdp" / "model.safetensors").read_bytes() == (
        tmp_path / "ddp" / "model.safetensors"
    ).read_bytes()
    result = check(fsdp([*args, "--mixed-precision", "bf16", "--output-dir", str(tmp_path / "bf16")]))
    assert (
        "FSDP keeps the 1 normalisation layers with running statistics in fp32 under bf16"
        in result.stdout + result.stderr
    )
    trained = weights(tmp_path / "bf16")
    assert trained["1.weight"].dtype == torch.float32 and not torch.equal(trained["1.weight"], torch.ones(8))


@pytest.mark.slow
def test_what_fsdp_cannot_resume_or_run_is_one_line(tmp_path, runs):
    ddp = tmp_path / "ddp"
    continue_from(complete_checkpoints(runs["ddp"])[0], ddp)
    result = fsdp([*TINY, "--batch-size", "4", "--output-dir", str(ddp), "--resume", "auto"])
    assert (
        result.returncode != 0
        and "holds DDP or single-process model and optimizer state and this run is FSDP" in result.stderr
    )
    from types import SimpleNamespace

    from acceltrain.checkpoint import Checkpointer
    from acceltrain.checkpoint.files import verify_checkpoint
    from acceltrain.engines import DeepSpeed

    sharded = complete_checkpoints(runs["fsdp"])[0]
    under_deepspeed = SimpleNamespace(engine=DeepSpeed(SimpleNamespace()))
    with pytest.raises(
        CheckpointError, match="holds FSDP model and optimizer state and this run is DeepSpeed: resume it under FSDP"
    ):
        Checkpointer._check_engine(under_deepspeed, sharded, verify_checkpoint(sharded))
    # another model with the same settings (a base folder replaced): a BatchNorm added, the config change allowed
    other = tmp_path / "other-model"
    continue_from(sharded, other)
    result = fsdp(
        [
            *TINY,
            "--batch-size",
            "4",
            "--batchnorm",
            "--allow-config-change",
            "--output-dir",
            str(other),
            "--resume",
            "auto",
        ]
    )
    assert (
        result.returncode != 0
        and "holds another model than this run's: 5 tensors differ (e.g. 1.bias: absent in the checkpoint, [8] here)"
        in result.stderr
    ), result.stderr[-2000:]
    assert "CheckpointException" not in result.stderr
    result = fsdp([*TINY, "--batch-size", "4", "--output-dir", str(tmp_path / "ema"), "--ema-decay", "0.9"])
    assert (
        result.returncode != 0
        and "EMA needs every process to hold the full weights: FSDP and DeepSpeed ZeRO-3 shard them" in result.stderr
    )


def test_merge_writes_the_weights_of_any_checkpoint_and_refuses_to_overwrite(tmp_path, runs, capsys):
    for name in ("fsdp", "ddp"):  # the last checkpoint is the last step: the run's exported weights
        merged = tmp_path / name
        assert main(["merge", str(complete_checkpoints(runs[name])[-1]), str(merged)]) == 0
        assert (
            all(weights(merged)[k].equal(v) for k, v in weights(runs[name]).items())
            and weights(merged).keys() == weights(runs[name]).keys()
        )
    capsys.readouterr()
    assert main(["merge", str(complete_checkpoints(runs["fsdp"])[-1]), str(tmp_path / "fsdp")]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"error: OUT {str(tmp_path / 'fsdp')!r} exists and is not an empty folder: choose a new one"
    )


def test_fsdp1_on_cpu_is_one_line(monkeypatch):
    import accelerate
    from accelerate.utils import DistributedType

    from acceltrain import ConfigError
    from acceltrain.engines import FSDP2

    monkeypatch.setattr(
        accelerate, "PartialState", lambda **_: type("State", (), {"distributed_type": DistributedType.MULTI_CPU})()
    )
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ConfigError, match="fsdp_version 1 on CPU processes: FSDP1 needs GPUs; use fsdp_version: 2"):
        FSDP2.build_accelerator(True)


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    sys.path.insert(0, str(REPO / "tests"))
    from test_causal_lm import write_text

    root = tmp_path_factory.mktemp("lm")
    env = {"HF_HOME": str(root / "home"), "HF_DATASETS_CACHE": str(root / "datasets"), "HF_HUB_OFFLINE": "1"}
    return write_text(root / "plays.txt"), env


@pytest.mark.slow
def test_the_language_model_shards_per_block_and_keeps_its_token_normalised_loss(tmp_path, text):
    """Uneven target counts per micro-batch and process, SGD:
    FSDP on 2 processes equals one process at twice the batch."""
    from test_causal_lm import EXACT, UNEVEN_RECIPE

    text_file, env = text
    sharded, single = tmp_path / "fsdp", tmp_path / "single"
    result = check(
        launch(
            UNEVEN_RECIPE,
            [*EXACT, "--text-files", str(text_file), "--batch-size", "4", "--output-dir", str(sharded)],
            processes=2,
            **FSDP,
            **env,
        )
    )
    assert (
        "FSDP shards each GPT2Block (the model's transformer blocks) and the root module"
        in result.stdout + result.stderr
    )
    check(
        launch(
            UNEVEN_RECIPE,
            [*EXACT, "--text-files", str(text_file), "--batch-size", "8", "--output-dir", str(single)],
            **env,
        )
    )
    assert_close(sharded, single, rtol=1e-4)


@pytest.mark.slow
def test_bf16_and_activation_checkpointing_run_sharded_and_the_weights_load_with_from_pretrained(tmp_path, text):
    from test_causal_lm import SMALL

    text_file, env = text
    out = tmp_path / "run"
    check(
        launch(
            REPO / "recipes" / "causal_lm.py",
            [
                *SMALL,
                "--text-files",
                str(text_file),
                "--batch-size",
                "4",
                "--max-steps",
                "3",
                "--mixed-precision",
                "bf16",
                "--activation-checkpointing",
                "--output-dir",
                str(out),
                "--save-every-steps",
                "3",
            ],
            processes=2,
            **FSDP,
            **env,
        )
    )
    assert read_summary(out)["mixed_precision"] == "bf16"
    merged = tmp_path / "merged"  # the last checkpoint's shards merged: the same weights, loadable the same way
    assert main(["merge", str(complete_checkpoints(out)[-1]), str(merged)]) == 0
    assert weights(merged).keys() == weights(out).keys()
    assert all(weights(merged)[k].equal(v) for k, v in weights(out).items())
    probe = (
        "import sys, json; from transformers import AutoModelForCausalLM; from safetensors.torch import load_file\n"
        "model, info = AutoModelForCausalLM.from_pretrained(sys.argv[1], output_loading_info=True)\n"
        "saved = load_file(sys.argv[1] + '/model.safetensors')\n"
        "print(json.dumps({'missing': sorted(info['missing_keys']), 'unexpected': sorted(info['unexpected_keys']), "
        "'class': type(model).__name__,\n"
        "                  'same': all(model.state_dict()[k].equal(v) for k, v in saved.items())}))"
    )
    for folder in (out, merged):
        loaded = json.loads(
            check(
                subprocess.run(
                    [sys.executable, "-c", probe, str(folder)],
                    env=subprocess_env(**env),
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        assert loaded == {"missing": [], "unexpected": [], "class": "GPT2LMHeadModel", "same": True}
