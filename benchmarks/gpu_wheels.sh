#!/usr/bin/env bash
# Fetch the wheels that benchmarks/gpu_check.sh installs on the GPU machine (which has no network) into
# the ignored folder .device/wheels, and the CIFAR-10 JPEG archive (20 MB) into .device for steps 5 and 6; the
# machine already has torch, accelerate, transformers, pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .device/wheels
python3 -m pip download -q --no-deps -d .device/wheels deepspeed hjson airbench==0.1.8
cp ../shared/datasets/cifar10-jpeg.tar.gz .device/ 2>/dev/null || echo "no ../shared/datasets/cifar10-jpeg.tar.gz: step 5 of gpu_check.sh will be skipped"
ls -la .device/wheels .device
