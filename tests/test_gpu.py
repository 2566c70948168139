"""Checks that need a CUDA GPU (skipped elsewhere): mixed precision, torch's own SyncBatchNorm, hook state on the
device, FSDP's sharded checkpoints."""

from __future__ import annotations

import pytest
from conftest import RECIPE, check, launch, read_summary

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_recipe_trains_in_mixed_precision_on_gpu(tmp_path, precision):
    out = tmp_path / precision
    check(
        launch(
            RECIPE,
            [
                "--dataset",
                "synthetic",
                "--model",
                "resnet_tiny",
                "--max-steps",
                "20",
                "--mixed-precision",
                precision,
                "--output-dir",
                str(out),
                "--no-progress",
            ],
        )
    )
    summary = read_summary(out)
    assert summary["mixed_precision"] == precision and summary["runtime"]["device"].startswith("cuda")
    assert summary["peak_allocated_mb"] > 0


def test_sync_bn_uses_torch_sync_batchnorm_on_gpu():
    import torch

    from acceltrain.runtime.distributed import convert_sync_batchnorm
    from acceltrain.vision import build_resnet

    model = convert_sync_batchnorm(build_resnet("resnet_tiny"), on_cpu=False)
    assert any(isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules())


def test_ema_and_fp16_resume_byte_identically_on_gpu(tmp_path):
    """A stateful hook's device tensors (the EMA on CUDA) and the fp16 grad scaler go through a checkpoint exactly."""
    from conftest import TINY_RECIPE

    common = [
        "--num-train",
        "256",
        "--batch-size",
        "16",
        "--epochs",
        "2",
        "--ema-decay",
        "0.9",
        "--mixed-precision",
        "fp16",
        "--no-progress",
        "--num-workers",
        "0",
        "--report-to",
        "none",
    ]
    full, part = tmp_path / "full", tmp_path / "part"
    check(launch(TINY_RECIPE, [*common, "--output-dir", str(full)]))
    stopped = launch(TINY_RECIPE, [*common, "--output-dir", str(part), "--stop-after-steps", "10"])
    assert stopped.returncode == 75, stopped.stderr[-2000:]
    check(launch(TINY_RECIPE, [*common, "--output-dir", str(part), "--resume", "auto"]))
    assert (part / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()
    assert "skipped_steps" in read_summary(full)


def test_fsdp_sharded_checkpoints_resume_and_a_planted_pickle_in_their_metadata_is_refused_on_gpu(tmp_path):
    """FSDP's load path: torch.distributed.checkpoint folders, whose ``.metadata`` DCP reads with plain pickle."""
    import shutil

    from conftest import REPO
    from test_no_code_on_resume import plant

    from acceltrain.checkpoint.files import complete_checkpoints

    config = tmp_path / "fsdp_sharded.yaml"
    config.write_text(
        (REPO / "accelerate_configs" / "fsdp.yaml").read_text().replace("FULL_STATE_DICT", "SHARDED_STATE_DICT")
    )
    fsdp = {"launcher": "accelerate", "config": str(config)}
    common = [
        "--dataset",
        "synthetic",
        "--model",
        "resnet_tiny",
        "--batch-size",
        "32",
        "--max-steps",
        "12",
        "--no-progress",
        "--num-workers",
        "0",
        "--report-to",
        "none",
    ]
    part, planted, marker = tmp_path / "part", tmp_path / "planted", tmp_path / "payload-ran"
    stopped = launch(RECIPE, [*common, "--output-dir", str(part), "--stop-after-steps", "6"], **fsdp)
    assert stopped.returncode == 75, stopped.stderr[-2000:]
    shutil.copytree(part, planted)
    (checkpoint,) = complete_checkpoints(planted)
    metadata = sorted(checkpoint.rglob(".metadata"))
    assert metadata, f"no sharded (DCP) state in {checkpoint}: {sorted(p.name for p in checkpoint.iterdir())}"
    plant(checkpoint, str(metadata[0].relative_to(checkpoint)), marker, plain_pickle=True)
    refused = launch(RECIPE, [*common, "--output-dir", str(planted), "--resume", "auto"], **fsdp)
    assert refused.returncode != 0 and ".metadata' cannot be loaded without running code" in refused.stderr
    assert not marker.exists(), "the checkpoint ran code"
    check(launch(RECIPE, [*common, "--output-dir", str(part), "--resume", "auto"], **fsdp))
    assert read_summary(part)["resumed_from_step"] == 6
