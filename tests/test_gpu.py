"""Checks that need a CUDA GPU (skipped elsewhere): mixed precision, torch's own SyncBatchNorm, hook state on the device."""

from __future__ import annotations

import pytest

from conftest import RECIPE, check, launch, read_summary

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_recipe_trains_in_mixed_precision_on_gpu(tmp_path, precision):
    out = tmp_path / precision
    check(launch(RECIPE, ["--dataset", "synthetic", "--model", "resnet_tiny", "--max-steps", "20",
                          "--mixed-precision", precision, "--output-dir", str(out), "--no-progress"]))
    summary = read_summary(out)
    assert summary["mixed_precision"] == precision and summary["runtime"]["device"].startswith("cuda")
    assert summary["peak_allocated_mb"] > 0


def test_sync_bn_uses_torch_sync_batchnorm_on_gpu():
    import torch

    from acceltrain.distributed import convert_sync_batchnorm
    from acceltrain.vision import build_resnet

    model = convert_sync_batchnorm(build_resnet("resnet_tiny"), on_cpu=False)
    assert any(isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules())


def test_ema_and_fp16_resume_byte_identically_on_gpu(tmp_path):
    """A stateful hook's device tensors (the EMA on CUDA) and the fp16 grad scaler go through a checkpoint exactly."""
    from conftest import TINY_RECIPE

    common = ["--num-train", "256", "--batch-size", "16", "--epochs", "2", "--ema-decay", "0.9", "--mixed-precision", "fp16",
              "--no-progress", "--num-workers", "0", "--report-to", "none"]
    full, part = tmp_path / "full", tmp_path / "part"
    check(launch(TINY_RECIPE, [*common, "--output-dir", str(full)]))
    stopped = launch(TINY_RECIPE, [*common, "--output-dir", str(part), "--stop-after-steps", "10"])
    assert stopped.returncode == 75, stopped.stderr[-2000:]
    check(launch(TINY_RECIPE, [*common, "--output-dir", str(part), "--resume", "auto"]))
    assert (part / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()
    assert "skipped_steps" in read_summary(full)
