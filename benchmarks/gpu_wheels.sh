#!/usr/bin/env bash
# Fetch the wheels that benchmarks/gpu_check.sh installs on the GPU machine (which has no network) into
# the ignored folder .device/wheels; the machine already has torch, accelerate, transformers, pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .device/wheels
python3 -m pip download -q --no-deps -d .device/wheels deepspeed hjson
ls -la .device/wheels
