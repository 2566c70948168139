"""Scale-out from the shipped configs: DeepSpeed ZeRO-2/3 (one CPU process), two "nodes" on one machine,
DDP's skipped all-reduce under accumulation, and one source of truth for DeepSpeed's settings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import RECIPE, REPO, TINY_RECIPE, _free_port, check, launch, read_summary, subprocess_env
from safetensors.torch import load_file

from acceltrain import ConfigError, TrainConfig
from acceltrain.checkpoint.files import checkpoint_dir
from acceltrain.engines.deepspeed import deepspeed_plugin

pytestmark = pytest.mark.multiprocess

CIFAR = [
    "--dataset",
    "synthetic",
    "--model",
    "resnet_tiny",
    "--batch-size",
    "16",
    "--grad-accum",
    "2",
    "--max-steps",
    "6",
    "--max-grad-norm",
    "1.0",
    "--no-progress",
    "--num-workers",
    "0",
    "--report-to",
    "none",
]


@pytest.mark.slow
# ZeRO-2's resume: the checkpoint matrix's deepspeed case (a SIGTERM) in the full suite; this one in the sweep tier
@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.sweep), 3])
def test_deepspeed_runs_saves_resumes_exactly_and_exports_plain_weights(tmp_path, stage):
    pytest.importorskip("deepspeed")
    config = f"deepspeed_zero{stage}.yaml"
    full, part = tmp_path / "full", tmp_path / "part"
    result = check(
        launch(
            RECIPE, [*CIFAR, "--output-dir", str(full), "--save-every-steps", "3"], launcher="accelerate", config=config
        )
    )
    assert "shm_comm" not in result.stdout, "one CPU process built DeepSpeed's shared-memory all-reduce op"
    summary = read_summary(full)
    assert summary["distributed_type"] == "DEEPSPEED" and summary["steps"] == 6
    step_3 = str(checkpoint_dir(full, 3))  # continued into another folder (stops: the matrix's)
    check(launch(RECIPE, [*CIFAR, "--output-dir", str(part), "--resume", step_3], launcher="accelerate", config=config))
    assert (part / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()
    from acceltrain.vision import build_resnet

    build_resnet("resnet_tiny").load_state_dict(load_file(str(full / "model.safetensors")))  # strict: every key


@pytest.fixture
def deepspeed_env(tmp_path, monkeypatch):
    def write(**fields):
        config = {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto",
            "gradient_clipping": "auto",
            "bf16": {"enabled": "auto"},
            "fp16": {"enabled": "auto"},
            "zero_optimization": {"stage": 2},
            **fields,
        }
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(config))
        monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
        monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(path))
        monkeypatch.setenv("WORLD_SIZE", "1")
        return path

    return write


def test_deepspeed_auto_fields_come_from_the_toolkit_config(deepspeed_env):
    pytest.importorskip("deepspeed")
    deepspeed_env()
    plugin = deepspeed_plugin(TrainConfig(batch_size=32, grad_accum=4, max_grad_norm=0.5, mixed_precision="bf16"))
    config = plugin.deepspeed_config
    assert (
        config["train_micro_batch_size_per_gpu"],
        config["gradient_accumulation_steps"],
        config["train_batch_size"],
    ) == (32, 4, 128)
    assert (
        config["gradient_clipping"] == 0.5 and config["bf16"]["enabled"] is True and config["fp16"]["enabled"] is False
    )


@pytest.mark.parametrize(
    "fields,cfg,message",
    [
        (
            {"train_micro_batch_size_per_gpu": 16},
            {"batch_size": 32},
            "train_micro_batch_size_per_gpu=16 but --batch-size gives 32",
        ),
        (
            {"gradient_accumulation_steps": 2},
            {"grad_accum": 4},
            "gradient_accumulation_steps=2 but --grad-accum gives 4",
        ),
        ({"fp16": {"enabled": True}}, {"mixed_precision": "bf16"}, "fp16.enabled=True but --mixed-precision is bf16"),
        ({"gradient_clipping": 1.0}, {"max_grad_norm": None}, "gradient_clipping=1.0 but --max-grad-norm gives 0.0"),
        ({"optimizer": {"type": "Adam"}}, {}, "defines an optimizer"),
    ],
)
def test_a_contradicting_deepspeed_json_is_a_one_line_error_naming_both(deepspeed_env, fields, cfg, message):
    deepspeed_env(**fields)
    with pytest.raises(ConfigError) as err:
        deepspeed_plugin(TrainConfig(**cfg))
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
def test_two_nodes_on_one_machine_form_one_job_with_identical_weights(tmp_path):
    """Two launcher invocations, machine ranks 0 and 1, rendezvous on loopback: one 2-process gloo job."""
    out, port = tmp_path / "run", str(_free_port())
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "accelerate_configs" / "multi_cpu.yaml"),
        "--num_machines",
        "2",
        "--num_processes",
        "2",
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        port,
    ]
    args = [
        str(TINY_RECIPE),
        "--output-dir",
        str(out),
        "--max-steps",
        "4",
        "--batch-size",
        "8",
        "--no-progress",
        "--num-workers",
        "0",
    ]
    nodes = [
        subprocess.Popen(
            [*command, "--machine_rank", str(rank), *args],
            cwd=REPO,
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    for node in nodes:
        _, stderr = node.communicate(timeout=300)
        assert node.returncode == 0, stderr[-3000:]
    summary = read_summary(out)
    assert (summary["num_processes"], summary["distributed_type"]) == (2, "MULTI_CPU")
    assert (out / "rank0.safetensors").read_bytes() == (out / "rank1.safetensors").read_bytes()


@pytest.mark.slow
def test_accumulation_under_ddp_all_reduces_only_on_optimizer_steps(tmp_path):
    """12 micro-batches per epoch in windows of 5, 5, 2: 3 all-reduces, not 12 (no_sync through accumulate)."""
    out = tmp_path / "run"
    check(
        launch(
            TINY_RECIPE,
            [
                "--num-train",
                "96",
                "--batch-size",
                "4",
                "--grad-accum",
                "5",
                "--epochs",
                "1",
                "--count-allreduce",
                "--output-dir",
                str(out),
                "--no-progress",
                "--num-workers",
                "0",
            ],
            processes=2,
            launcher="accelerate",
        )
    )
    for rank in (0, 1):
        counts = json.loads((out / f"rank{rank}.json").read_text())
        assert counts["steps"] == 3 and counts["allreduces"] == 3  # the tiny net fits one bucket


@pytest.mark.parametrize("exit_code", [0, 75, 2])
def test_slurm_script_launches_each_node_with_its_rank_and_requeues_only_a_stopped_run(tmp_path, exit_code):
    """The sbatch script with stand-ins for srun, scontrol and accelerate: the command each node runs; a requeue
    only when the run stopped to be resumed (exit 75), any other exit passed through (the real SLURM's side is
    tests/test_slurm.py)."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "resnet_cifar.py").write_text("")
    stubs = {
        "srun": 'for node in 0 1; do SLURM_NODEID=$node "${@:2}" || exit $?; done',  # skip --kill-on-bad-exit
        "scontrol": 'if [ "$1" = show ]; then printf "node-a\\nnode-b\\n"; else echo "scontrol $*" >> "$CALLS"; fi',
        "accelerate": f'echo "accelerate $*" >> "$CALLS"; exit {exit_code}',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = subprocess_env(
        PATH=f"{bin_dir}:/usr/bin:/bin",
        CALLS=str(calls),
        SLURM_JOB_NAME="demo",
        SLURM_JOB_ID="42",
        SLURM_JOB_NODELIST="node-[a-b]",
        SLURM_NNODES="2",
        SLURM_GPUS_ON_NODE="4",
    )
    result = subprocess.run(
        [
            "bash",
            str(REPO / "recipes" / "slurm" / "train.sbatch"),
            "recipes/resnet_cifar.py",
            "--lr",
            "0.2",
            "--run-name",
            "two words",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == exit_code, result.stderr
    lines = calls.read_text().splitlines()
    launches = [line for line in lines if line.startswith("accelerate")]
    assert len(launches) == (2 if exit_code == 0 else 1)
    for rank, line in enumerate(launches):
        assert f"--machine_rank {rank}" in line and "--num_processes 8" in line and "--main_process_ip node-a" in line
        assert line.endswith(
            "recipes/resnet_cifar.py --save-every-minutes 30 --resume auto --output-dir runs/demo --lr 0.2 --run-name "
            "two words"
        )
    assert ("scontrol requeue 42" in lines) == (exit_code == 75)
