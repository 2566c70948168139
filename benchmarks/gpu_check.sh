#!/usr/bin/env bash
# The GPU check, sized for one lent H200 in about 9 minutes (never run on a GPU yet; nothing can be downloaded there):
#   1. the GPU-marked tests;
#   2. ResNet-50 (CIFAR stem, synthetic CIFAR-shaped data, batch 256) through `acceltrain bench`:
#      fp32 -> bf16 -> + channels_last -> + torch.compile -> + on-device loader;
#   3. the same model on one GPU through the shipped configs: plain (single_gpu), DeepSpeed ZeRO-2,
#      ZeRO-3 and FSDP2, throughput and peak memory side by side;
#   4. GPT-2 small (124M, 1,024-token blocks) through recipes/causal_lm.py in bf16 with torch.compile on
#      generated text: tokens/s and MFU;
#   5. time to 94% on the real CIFAR-10 (the JPEG copy carried in .device): the cifar10_fast preset through
#      accelerate launch on one GPU, evaluated every epoch until 94% (target: <= 2.5 s, <= 10 epochs);
#   6. airbench94's own code on the same GPU, the ratio's baseline (benchmarks/peers.py --rows airbench);
#   7. FSDP2's sharded checkpoints on the GPU (issue 32): GPT-2 small under fsdp.yaml, a save every 10 steps,
#      synchronous vs --async-checkpoint: the seconds saving blocked training (target: async <= 0.2x);
#   8. checkpoints that always resume, on the GPU (issue 36): README's own FSDP example (fsdp.yaml, bf16, a BatchNorm
#      ResNet), stopped at step 10 with --async-checkpoint and resumed, against the run never stopped (target: the
#      same model.safetensors bytes).
# Prepare once on a machine with network: bash benchmarks/gpu_wheels.sh  (wheels into .device/wheels)
# Then, with the device tool:  run(command="bash benchmarks/gpu_check.sh", carry=[".device"], timeout_s=590)
# Results: $OUT (the device tool's output folder) or benchmarks/results/gpu/.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${OUT:-benchmarks/results/gpu}
mkdir -p "$RESULTS"
export PYTHONPATH=$PWD WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
if [ -d .device/wheels ]; then
    python3 -m pip install -q --no-index --find-links .device/wheels deepspeed hjson airbench 2>&1 | tail -1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$RESULTS/gpu.txt"

echo "== 1. GPU tests"
timeout 240 python3 -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tail -3 | tee "$RESULTS/gpu_tests.txt"

echo "== 2. ResNet-50 speed ladder"
timeout 300 python3 -m acceltrain.commands.cli bench --model resnet50 --dataset synthetic --batch-size 256 --steps 30 --warmup 10 \
    --rows fp32,mixed-precision,channels-last,compile,device-loader --output-dir "$RESULTS/bench" 2>&1 | tail -12

echo "== 3. Backends on one GPU (bf16, batch 256, 30 timed steps)"
for config in single_gpu deepspeed_zero2 deepspeed_zero3 fsdp; do
    timeout 120 python3 -m accelerate.commands.launch --config_file "accelerate_configs/$config.yaml" --num_processes 1 \
        recipes/resnet_cifar.py --model resnet50 --dataset synthetic --batch-size 256 --max-steps 40 --timing-warmup-steps 10 \
        --mixed-precision bf16 --report-to none --no-progress --output-dir "$RESULTS/$config" --overwrite \
        > "$RESULTS/$config.log" 2>&1 || echo "$config: failed, see $config.log: $(grep -m1 'error:' "$RESULTS/$config.log")"
done
python3 - "$RESULTS" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1]); rows = ["| config | samples/s | ms/step | peak allocated MB | vs single_gpu |", "| --- | ---: | ---: | ---: | ---: |"]
base = None
for config in ("single_gpu", "deepspeed_zero2", "deepspeed_zero3", "fsdp"):
    path = out / config / "summary.json"
    if not path.exists():
        rows.append(f"| {config} | failed | | | |"); continue
    s = json.loads(path.read_text()); base = base or s["samples_per_second"]
    rows.append(f"| {config} | {s['samples_per_second']:.0f} | {s['ms_per_step']:.1f} | {s.get('peak_allocated_mb', 0):.0f} | {s['samples_per_second'] / base:.2f}x |")
(out / "backends.md").write_text("\n".join(rows) + "\n"); print("\n".join(rows))
PY

echo "== 4. GPT-2 small, bf16 + compile (generated text; tokens/s and MFU)"
python3 -c "import random; r = random.Random(0); w = 'the king queen lord sword crown night day love war speak good ill heart'.split(); open('/tmp/lm.txt', 'w').write(''.join(' '.join(r.choice(w) for _ in range(r.randint(5, 30))) + '.\\n' for _ in range(200000)))"
timeout 180 python3 recipes/causal_lm.py --config recipes/configs/lm_gpt2_124m_gpu.yaml --text-files /tmp/lm.txt --vocab-size 8192 \
    --grad-accum 1 --max-steps 40 --timing-warmup-steps 10 --eval-fraction 0 --compile --report-to none --no-progress \
    --output-dir "$RESULTS/gpt2_small" --overwrite > "$RESULTS/gpt2_small.log" 2>&1 || echo "gpt2_small: failed, see gpt2_small.log"
python3 -c "import json, sys; s = json.load(open(sys.argv[1])); print({k: s.get(k) for k in ('tokens_per_second', 'mfu', 'ms_per_step', 'compile_seconds', 'peak_allocated_mb')})" \
    "$RESULTS/gpt2_small/summary.json" 2>/dev/null | tee "$RESULTS/gpt2_small.txt"

echo "== 5. Time to 94% on CIFAR-10 (cifar10_fast preset, one GPU, accelerate launch)"
if [ -f .device/cifar10-jpeg.tar.gz ]; then
    mkdir -p /tmp/cifar10-jpeg && tar xzf .device/cifar10-jpeg.tar.gz -C /tmp/cifar10-jpeg
    timeout 200 python3 -m accelerate.commands.launch --config_file accelerate_configs/single_gpu.yaml recipes/resnet_cifar.py \
        --config cifar10_fast --dataset imagefolder --data-dir /tmp/cifar10-jpeg --target-accuracy 0.94 --eval-every 48 \
        --report-to none --no-progress --output-dir "$RESULTS/cifar10_fast" --overwrite > "$RESULTS/cifar10_fast.log" 2>&1 \
        || echo "cifar10_fast: failed, see cifar10_fast.log: $(grep -m1 'error:' "$RESULTS/cifar10_fast.log")"
    python3 -c "import json, sys; s = json.load(open(sys.argv[1])); print({k: s.get(k) for k in ('eval_accuracy', 'epochs', 'time_to_target_seconds', 'wall_seconds', 'samples_per_second')})" \
        "$RESULTS/cifar10_fast/summary.json" 2>/dev/null | tee "$RESULTS/cifar10_fast.txt"
else
    echo "skipped: .device/cifar10-jpeg.tar.gz absent (bash benchmarks/gpu_wheels.sh copies it there)"
fi

echo "== 6. airbench94's own train94 next to cifar10_fast on this GPU (peers.py's airbench row, 10 epochs)"
timeout 240 python3 benchmarks/peers.py --rows airbench --epochs 10 > "$RESULTS/peers_airbench.log" 2>&1 \
    || echo "peers airbench: failed, see peers_airbench.log"
tail -4 "$RESULTS/peers_airbench.log"; cp benchmarks/results/peers.json "$RESULTS/" 2>/dev/null

echo "== 7. FSDP2 checkpoints on one GPU: synchronous vs --async-checkpoint (GPT-2 small, bf16, a save every 10 steps)"
for mode in sync async; do
    timeout 150 python3 -m accelerate.commands.launch --config_file accelerate_configs/fsdp.yaml --num_processes 1 recipes/causal_lm.py \
        --config recipes/configs/lm_gpt2_124m_gpu.yaml --text-files /tmp/lm.txt --vocab-size 8192 --grad-accum 1 --max-steps 30 \
        --save-every-steps 10 --keep-last 1 --eval-fraction 0 --report-to none --no-progress $([ $mode = async ] && echo --async-checkpoint) \
        --output-dir "$RESULTS/fsdp_$mode" --overwrite > "$RESULTS/fsdp_$mode.log" 2>&1 || echo "fsdp $mode: failed, see fsdp_$mode.log"
done
python3 -c "import json, sys; s = [json.load(open(p)) for p in sys.argv[1:]]; print({'sync_checkpoint_seconds': s[0]['checkpoint_seconds'], 'async_checkpoint_seconds': s[1]['checkpoint_seconds'], 'ratio': round(s[1]['checkpoint_seconds'] / s[0]['checkpoint_seconds'], 3), 'tokens_per_second': [x.get('tokens_per_second') for x in s]})" \
    "$RESULTS/fsdp_sync/summary.json" "$RESULTS/fsdp_async/summary.json" 2>/dev/null | tee "$RESULTS/fsdp_checkpoints.txt"

echo "== 8. FSDP2 + bf16 + BatchNorm on one GPU: async checkpoint, stop, resume = the run never stopped"
ARGS="--model resnet_tiny --dataset synthetic --batch-size 64 --max-steps 20 --save-every-steps 5 --mixed-precision bf16 --report-to none --no-progress"
LAUNCH="python3 -m accelerate.commands.launch --config_file accelerate_configs/fsdp.yaml --num_processes 1 recipes/resnet_cifar.py"
timeout 100 $LAUNCH $ARGS --output-dir "$RESULTS/resume_full" --overwrite > "$RESULTS/resume_full.log" 2>&1 || echo "resume full: failed"
timeout 100 $LAUNCH $ARGS --async-checkpoint --stop-after-steps 10 --output-dir "$RESULTS/resume_cut" --overwrite > "$RESULTS/resume_cut.log" 2>&1
timeout 100 $LAUNCH $ARGS --async-checkpoint --resume auto --output-dir "$RESULTS/resume_cut" > "$RESULTS/resume_cut2.log" 2>&1 || echo "resume: failed"
cmp -s "$RESULTS/resume_full/model.safetensors" "$RESULTS/resume_cut/model.safetensors" && echo "resumed: the same bytes" \
    | tee "$RESULTS/resume.txt" || echo "resumed: DIFFERENT bytes" | tee "$RESULTS/resume.txt"
