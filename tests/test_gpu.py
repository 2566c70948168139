"""Checks that need a CUDA GPU (skipped elsewhere): mixed precision and torch's own SyncBatchNorm."""

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
