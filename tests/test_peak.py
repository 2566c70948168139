"""The measured peak behind MFU (issue 46 item 2), without a run: which shape is calibrated, how the calibration
stops (a fake clock: nothing here depends on the machine's speed), and the cache per machine, dtype and shape."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from acceltrain.runtime import peak
from acceltrain.train.speed import matmul_shape


class Conv1D(nn.Module):  # transformers' GPT-2 layer keeps a (inputs, outputs) weight
    def __init__(self, inputs: int, outputs: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(inputs, outputs))


@pytest.mark.parametrize(
    "model,shape",
    [
        (nn.Sequential(nn.Linear(300, 700), nn.Linear(700, 20)), (2048, 300, 700)),
        (nn.Sequential(nn.Conv2d(64, 128, 3), nn.Linear(10, 10)), (2048, 576, 256)),  # 64 x 3 x 3 inputs
        (nn.Sequential(Conv1D(512, 1536), nn.Embedding(50000, 512)), (2048, 512, 1536)),  # an embedding is no matmul
        (nn.Sequential(nn.Linear(4, 8)), (2048, 256, 256)),  # a tiny layer: at least 256 a side
        (nn.Sequential(nn.ReLU()), (2048, 1024, 1024)),
        (None, (2048, 1024, 1024)),
    ],
)
def test_the_calibration_takes_the_models_largest_dense_layer(model, shape):
    assert matmul_shape(model) == shape


class FakeDevice:
    """A matmul that takes ``seconds`` of a fake clock: time moves with the work done, as on a real device, and
    nothing depends on this machine's speed."""

    def __init__(self, seconds: float):
        self.now, self.seconds, self.products = 0.0, seconds, 0

    def clock(self) -> float:
        return self.now

    def mm(self, a, b):
        self.now += self.seconds
        self.products += 1


def calibrate(monkeypatch, device: FakeDevice, shape=(8, 4, 2)) -> float:
    monkeypatch.setattr(peak.torch, "mm", device.mm)
    return peak._calibrate(torch.device("cpu"), torch.float32, shape, device.clock)


def test_the_calibration_stops_once_rounds_bring_no_gain(monkeypatch):
    device = FakeDevice(2 * peak.ROUND_SECONDS)  # every round long enough to be timed
    best = calibrate(monkeypatch, device)
    assert device.products == peak.PATIENCE + 1  # the first round sets the best, then PATIENCE bring no gain of 1%
    assert best == pytest.approx(2 * 8 * 4 * 2 / device.seconds)


def test_short_rounds_are_lengthened_to_be_timed(monkeypatch):
    device = FakeDevice(peak.ROUND_SECONDS / 10)
    best = calibrate(monkeypatch, device)
    assert device.products > 10 * peak.PATIENCE, "rounds of several matmuls"
    assert best == pytest.approx(2 * 8 * 4 * 2 / device.seconds)


def test_the_time_budget_bounds_the_calibration(monkeypatch):
    monkeypatch.setattr(peak, "PATIENCE", 10**6)  # never stale: only the budget ends it
    device = FakeDevice(1.0)
    calibrate(monkeypatch, device)
    assert device.now <= peak.BUDGET_SECONDS


def test_a_machine_calibrates_each_dtype_and_shape_once(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELTRAIN_CACHE", str(tmp_path))
    calls = []

    def measure(device, dtype, shape, clock):
        calls.append((dtype, shape))
        return 1e9 * len(calls)

    cpu = torch.device("cpu")
    assert peak.measured_peak_flops(cpu, "no", (2048, 256, 256), measure=measure) == 1e9
    assert peak.measured_peak_flops(cpu, "no", (2048, 256, 256), measure=measure) == 1e9  # cached
    assert peak.measured_peak_flops(cpu, "bf16", (2048, 256, 256), measure=measure) == 2e9
    assert peak.measured_peak_flops(cpu, "no", (2048, 512, 256), measure=measure) == 3e9
    assert calls == [
        (torch.float32, (2048, 256, 256)),
        (torch.bfloat16, (2048, 256, 256)),
        (torch.float32, (2048, 512, 256)),
    ]
    cached = json.loads((tmp_path / peak.CACHE_FILE).read_text())
    assert len(cached) == 3 and all(f"torch {torch.__version__}" in key for key in cached)
    assert not list(tmp_path.glob(".peak_flops.json.*")), "written atomically, nothing left beside it"


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"key": "fast"}'])
def test_an_unreadable_cache_only_costs_a_calibration(tmp_path, monkeypatch, content):
    monkeypatch.setenv("ACCELTRAIN_CACHE", str(tmp_path))
    (tmp_path / peak.CACHE_FILE).write_text(content)
    assert peak.measured_peak_flops(torch.device("cpu"), "no", (2048, 256, 256), measure=lambda *_: 5e9) == 5e9
    assert list(json.loads((tmp_path / peak.CACHE_FILE).read_text()).values())[-1] == 5e9
