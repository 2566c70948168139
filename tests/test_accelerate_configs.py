"""The shipped Accelerate configs load with Accelerate's own loader and say what their headers promise."""

import json
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DistributedType

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "accelerate_configs"

# file name -> (distributed_type, num_processes)
EXPECTED = {
    "cpu.yaml": (DistributedType.NO, 1),
    "single_gpu.yaml": (DistributedType.NO, 1),
    "multi_gpu.yaml": (DistributedType.MULTI_GPU, 8),
    # MULTI_GPU on purpose: MULTI_CPU makes `accelerate launch` start one process (it expects mpirun);
    # acceltrain passes cpu=True without an accelerator, so torchrun's 2 processes join as MULTI_CPU.
    "multi_cpu.yaml": (DistributedType.MULTI_GPU, 2),
    "multi_node.yaml": (DistributedType.MULTI_GPU, 16),
    "deepspeed_zero2.yaml": (DistributedType.DEEPSPEED, 1),
    "deepspeed_zero3.yaml": (DistributedType.DEEPSPEED, 1),
    "fsdp.yaml": (DistributedType.FSDP, 8),
    "fsdp_cpu.yaml": (DistributedType.FSDP, 2),  # 2 gloo processes: acceltrain.engines.fsdp2 sets FSDP2 up on them
}
CONFIGS = sorted(p.name for p in CONFIG_DIR.glob("*.yaml"))
AUTO_FIELDS = ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps", "gradient_clipping")


def test_every_config_is_covered():
    assert CONFIGS == sorted(EXPECTED)


@pytest.mark.parametrize("name", CONFIGS)
def test_config_loads_and_has_header(name):
    path = CONFIG_DIR / name
    lines = path.read_text(encoding="utf-8").splitlines()
    header = []
    for line in lines:
        if not line.startswith("#"):
            break
        header.append(line)
    assert 3 <= len(header) <= 8, f"{name}: header comment should be 3-8 lines, got {len(header)}"
    assert f"accelerate launch --config_file accelerate_configs/{name}" in "\n".join(header)

    cfg = load_config_from_file(str(path))
    distributed_type, num_processes = EXPECTED[name]
    assert cfg.distributed_type == distributed_type
    assert cfg.num_processes == num_processes
    if name == "multi_node.yaml":
        assert (cfg.num_machines, cfg.machine_rank, cfg.main_process_port) == (2, 0, 29500)
        assert cfg.rdzv_backend == "static" and cfg.same_network
    if name.startswith("fsdp"):
        assert cfg.fsdp_config["fsdp_version"] == 2  # FSDP1 does not run on CPU
        assert cfg.fsdp_config["fsdp_auto_wrap_policy"] == "SIZE_BASED_WRAP"  # a transformer's blocks: chosen per model
        assert (
            cfg.fsdp_config["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
        )  # DCP: another process count, async saves
        assert isinstance(cfg.fsdp_config["fsdp_reshard_after_forward"], bool)  # FSDP2 wants a bool


@pytest.mark.parametrize("name", [n for n in CONFIGS if n.startswith("deepspeed")])
def test_deepspeed_json(name):
    cfg = load_config_from_file(str(CONFIG_DIR / name))
    # Accelerate refuses these in the YAML when a DeepSpeed JSON is given: the JSON owns them.
    assert cfg.mixed_precision is None and "gradient_accumulation_steps" not in cfg.deepspeed_config
    json_path = ROOT / cfg.deepspeed_config["deepspeed_config_file"]
    ds = json.loads(json_path.read_text(encoding="utf-8"))
    for field in AUTO_FIELDS:
        assert ds[field] == "auto", field
    assert ds["bf16"]["enabled"] == "auto" and ds["fp16"]["enabled"] == "auto"
    stage = 3 if "zero3" in name else 2
    assert ds["zero_optimization"]["stage"] == stage
    assert cfg.deepspeed_config["zero3_init_flag"] is (stage == 3)
    assert "optimizer" not in ds and "scheduler" not in ds
    # "auto" here needs model.config.hidden_size (Hugging Face models only); ResNets have none.
    for key, value in ds["zero_optimization"].items():
        assert value != "auto", key
