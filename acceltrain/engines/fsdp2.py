"""FSDP2: each process holds a shard of every sharded tensor (``fully_shard`` per block, then the root), on GPUs and
on CPU processes over gloo alike.

Accelerate 1.16 turns a launch that asks for FSDP into ``DistributedType.FSDP`` only inside its multi-GPU
branch (``AcceleratorState.__init__``): on CPU processes the plugin is left unused and the run is plain DDP,
with no warning. Its FSDP2 path itself runs on CPU (``fully_shard`` over gloo, DCP checkpoints, full-weight
gathering), so :func:`build_accelerator` lets Accelerate take that branch: while the ``Accelerator`` is built,
the already-joined CPU state reads as multi-GPU, and Accelerate sets up FSDP as it would on GPUs (the plugin
from the launch's ``FSDP_*`` settings, its mixed-precision policy, ``DistributedType.FSDP``). The device and
the backend (CPU, gloo) were fixed when the processes joined.

What is sharded is chosen per model (:func:`choose_wrap_policy`): a Hugging Face model wraps each transformer
block it names in ``_no_split_modules``, any other model its modules of at least ``fsdp_min_num_params``
parameters; the root module always holds the rest.
"""

from __future__ import annotations

import os

import torch
from accelerate.logging import get_logger
from accelerate.utils import DistributedType
from torch import nn
from torch.distributed.checkpoint import DefaultSavePlanner

from acceltrain.accelerate_compat import FSDP_MODEL_NAME, OPTIMIZER_NAME, building_fsdp_on_cpu
from acceltrain.config.options import ConfigError
from acceltrain.engines.base import ENGINE, SHARDS, Engine, Part, accelerator_present, training_accelerator

logger = get_logger(__name__)
SHARDED_MODEL, SHARDED_OPTIMIZER = f"{FSDP_MODEL_NAME}_0", f"{OPTIMIZER_NAME}_0"  # the checkpoint's DCP folders


class FSDP2(Engine):
    name = "FSDP"
    checkpoint_format = "FSDP"
    distributed_types = (DistributedType.FSDP,)
    launch_variable = "ACCELERATE_USE_FSDP"
    keeps_weight_matrices = False
    refusals = {
        "merge_lora": (
            "--merge-lora needs the whole weights on one process and FSDP shards them: drop --merge-lora and merge the "
            "adapter afterwards (AutoPeftModelFor...from_pretrained(run_dir).merge_and_unload().save_pretrained(out))"
        ),
    }

    @classmethod
    def build_accelerator(cls, on_cpu: bool, **kwargs):
        """FSDP2 on CPU processes where the launch asks for them (Accelerate would run plain DDP there)."""
        from accelerate import PartialState

        if PartialState().distributed_type != DistributedType.MULTI_CPU:
            return super().build_accelerator(on_cpu, **kwargs)
        version = os.environ.get("FSDP_VERSION", "1")
        if version != "2":
            raise ConfigError(
                f"fsdp_version {version} on CPU processes: FSDP1 needs GPUs; use fsdp_version: 2 "
                "(accelerate_configs/fsdp_cpu.yaml)"
            )
        if accelerator_present():
            raise ConfigError(
                "FSDP on CPU processes of a machine with an accelerator: FSDP would build its device mesh on the "
                "accelerator; train on it (accelerate_configs/fsdp.yaml), or use DDP on CPU (multi_cpu.yaml)"
            )
        with building_fsdp_on_cpu():
            accelerator = training_accelerator()(cpu=True, **kwargs)
        if not (
            accelerator.distributed_type == DistributedType.FSDP
            and accelerator.is_fsdp2
            and accelerator.device.type == "cpu"
        ):
            raise ConfigError(
                f"FSDP2 on CPU processes could not be set up (Accelerate set up {accelerator.distributed_type.value}):"
                " use DDP on CPU (multi_cpu.yaml)"
            )
        if accelerator.num_processes == 1:
            logger.warning(
                "FSDP on 1 process shards nothing (each process holds 1/N of each sharded tensor): it runs, so that "
                "a sharded checkpoint can continue on one process; to save memory, launch more processes"
            )
        return accelerator

    def before_prepare(self, model: nn.Module, optimizer) -> list[str]:
        return [
            note
            for note in (
                choose_wrap_policy(self.accelerator, model),
                keep_norms_in_fp32(self.accelerator, model, optimizer),
            )
            if note
        ]

    def after_prepare(self, model: nn.Module) -> list[str]:
        return [
            note
            for note in (
                guard_gradient_average(self.accelerator, model),
                share_norm_statistics(self.accelerator, model),
            )
            if note
        ]

    def settings(self) -> dict:
        plugin = self.accelerator.state.fsdp_plugin
        keys = (
            "fsdp_version",
            "reshard_after_forward",
            "state_dict_type",
            "auto_wrap_policy",
            "cpu_offload",
            "mixed_precision_policy",
        )
        return {"fsdp": {key: str(getattr(plugin, key, None)) for key in keys}}

    def holds_whole_weights(self) -> bool:
        return False

    def checkpoint_parts(self, model, optimizer, frozen: frozenset[str]) -> list[Part]:
        """Sharded state dicts: DCP folders ``pytorch_model_fsdp_0/`` and ``optimizer_0/``, each process writing its
        shards (each with a save planner of its own: DCP caches plans by the planner's class name); with full state
        dicts, Accelerate's own files, written at the save. The shards hold every weight, an adapter run's too."""
        accelerator = self.accelerator
        if self.writes_own_files():
            from accelerate.utils import save_fsdp_model, save_fsdp_optimizer

            def write(folder) -> None:
                save_fsdp_model(accelerator.state.fsdp_plugin, accelerator, model, str(folder))
                save_fsdp_optimizer(accelerator.state.fsdp_plugin, accelerator, optimizer, model, str(folder))

            return [Part(FSDP_MODEL_NAME, write, ENGINE)]
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        return [
            Part(SHARDED_MODEL, {"model": get_model_state_dict(model)}, SHARDS, ModelSavePlanner),
            Part(
                SHARDED_OPTIMIZER,
                {"optimizer": get_optimizer_state_dict(model, optimizer.optimizer)},
                SHARDS,
                OptimizerSavePlanner,
            ),
        ]

    def load_parts(self, folder, model, optimizer, *, strict: bool = True) -> None:
        """Each process reads its shards of the DCP folders back (DCP reshards them onto another process count); with
        full state dicts, Accelerate's readers of the files its writers wrote."""
        if self.writes_own_files():
            from accelerate.utils import load_fsdp_model, load_fsdp_optimizer

            plugin = self.accelerator.state.fsdp_plugin
            load_fsdp_model(plugin, self.accelerator, model, str(folder))
            load_fsdp_optimizer(plugin, self.accelerator, optimizer, model, str(folder))
            return
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        weights = {"model": get_model_state_dict(model)}
        dcp.load(weights, checkpoint_id=str(folder / SHARDED_MODEL))
        set_model_state_dict(model, weights["model"])
        state = {"optimizer": get_optimizer_state_dict(model, optimizer.optimizer)}  # the torch optimizer: getting
        # a fresh one's state steps it once, which must not step the fp16 grad scaler in Accelerate's wrapper
        dcp.load(state, checkpoint_id=str(folder / SHARDED_OPTIMIZER))
        set_optimizer_state_dict(model, optimizer.optimizer, state["optimizer"])

    def writes_own_files(self) -> bool:
        return "SHARDED" not in str(self.accelerator.state.fsdp_plugin.state_dict_type)

    def check_async_supported(self) -> None:
        if self.writes_own_files():
            raise ConfigError(
                "--async-checkpoint under FSDP needs fsdp_state_dict_type: SHARDED_STATE_DICT in the accelerate "
                "config (accelerate_configs/fsdp_cpu.yaml, fsdp.yaml)"
            )

    def sharded_model(self) -> str | None:
        return SHARDED_MODEL

    @classmethod
    def merged_weights(cls, checkpoint, out) -> dict:
        """The DCP shards merged into ``out/model.safetensors`` (Accelerate's ``merge_fsdp_weights``), then read."""
        from accelerate.utils import merge_fsdp_weights
        from safetensors.torch import load_file

        from acceltrain.accelerate_compat import SAFE_WEIGHTS_NAME

        if not (checkpoint / SHARDED_MODEL).is_dir():
            raise ConfigError(
                f"checkpoint {str(checkpoint)!r} holds FSDP's full state dict, not DCP shards: use "
                "fsdp_state_dict_type: SHARDED_STATE_DICT, or load it under FSDP"
            )
        merge_fsdp_weights(str(checkpoint / SHARDED_MODEL), str(out), safe_serialization=True)
        return load_file(str(out / SAFE_WEIGHTS_NAME))


class ModelSavePlanner(DefaultSavePlanner):
    """DCP's planner for the model's shards; a class of its own, so that its cached plan is the model's."""


class OptimizerSavePlanner(DefaultSavePlanner):
    """DCP's planner for the optimizer's shards (sharing one cache with the model's ended runs at the 2nd save)."""


def choose_wrap_policy(accelerator, model: nn.Module) -> str | None:
    """Set the FSDP plugin's auto-wrap policy for ``model`` before ``prepare`` (a note for the log, or None when
    not under FSDP). A transformer's blocks are its ``_no_split_modules``; wrapping by size would try to shard
    its ``ModuleList`` of blocks, which ``fully_shard`` refuses (a container without ``forward``)."""
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    plugin = accelerator.state.fsdp_plugin
    blocks = _transformer_blocks(model)
    if plugin.auto_wrap_policy is None and not os.environ.get("FSDP_AUTO_WRAP_POLICY"):
        plugin.auto_wrap_policy = transformer_auto_wrap_policy if blocks else size_based_auto_wrap_policy
    elif plugin.auto_wrap_policy is size_based_auto_wrap_policy and blocks:
        plugin.auto_wrap_policy = transformer_auto_wrap_policy
    elif (
        plugin.auto_wrap_policy is transformer_auto_wrap_policy
        and not blocks
        and not plugin.transformer_cls_names_to_wrap
    ):
        plugin.auto_wrap_policy = size_based_auto_wrap_policy
    if plugin.auto_wrap_policy is transformer_auto_wrap_policy:
        if not plugin.transformer_cls_names_to_wrap:  # Accelerate would take every _no_split_modules class
            plugin.transformer_cls_names_to_wrap = blocks
        names = plugin.transformer_cls_names_to_wrap
        return f"FSDP shards each {', '.join(names)} (the model's transformer blocks) and the root module"
    if plugin.auto_wrap_policy is size_based_auto_wrap_policy:
        return f"FSDP shards each module of at least {plugin.min_num_params:,} parameters and the root module"
    return "FSDP shards the root module as one unit (fsdp_auto_wrap_policy: NO_WRAP)"


def _transformer_blocks(model: nn.Module) -> list[str]:
    """The class names in the model's ``_no_split_modules`` that it has (Transformers lists some it may lack), but
    one that holds the input embeddings (BERT's ``BertEmbeddings``): Accelerate shards the input embeddings as a unit
    of their own after the blocks, which fails on an embedding already sharded inside one."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    get_embeddings = getattr(model, "get_input_embeddings", None)
    embeddings = get_embeddings() if callable(get_embeddings) else None
    holders = {
        type(module).__name__
        for module in model.modules()
        if embeddings is not None and module is not embeddings and any(sub is embeddings for sub in module.modules())
    }
    return sorted(({type(module).__name__ for module in model.modules()} & names) - holders)


def average_reduction_works(group=None) -> bool:
    """Whether ``reduce_scatter`` with ``ReduceOp.AVG``, which FSDP2 uses for the gradients, averages on this
    backend: gloo is reported to sum instead (pytorch#162338, open; not seen with torch 2.14.1), which would
    double the gradients of 2 processes silently."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    mine = torch.full((world,), float(dist.get_rank(group) + 1))
    out = torch.zeros(1)
    dist.reduce_scatter_tensor(out, mine, op=dist.ReduceOp.AVG, group=group)
    return abs(out.item() - (world + 1) / 2) < 1e-6


def guard_gradient_average(accelerator, model: nn.Module) -> str | None:
    """After ``prepare`` under FSDP on gloo: when the backend's AVG sums (:func:`average_reduction_works`), every
    FSDP unit reduces with SUM and divides (``set_force_sum_reduction_for_comms``, which is not recursive)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    if dist.get_backend() != "gloo" or accelerator.num_processes == 1:
        return None
    if average_reduction_works():
        return None
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return "gloo's ReduceOp.AVG sums here (pytorch#162338): FSDP reduces gradients with SUM and divides instead"


def keep_norms_in_fp32(accelerator, model: nn.Module, optimizer) -> str | None:
    """Before ``prepare`` under FSDP with mixed precision: each normalisation layer that keeps running statistics
    (BatchNorm) becomes an FSDP unit of its own whose parameters stay in fp32. FSDP would cast its weight to bf16 while
    its running statistics stay fp32, which ``batch_norm`` refuses; in fp32 it takes the bf16 activations as they come
    (as under autocast, on CPU and GPU alike). Accelerate's own wrapping then leaves these units alone; the optimizer
    is given the sharded parameters in place of the ones it held (Accelerate maps the others itself)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if accelerator.mixed_precision == "no":
        return None
    norms = [module for module in model.modules() if _keeps_running_statistics(module)]
    if not norms:
        return None
    plugin = accelerator.state.fsdp_plugin
    policy = plugin.mixed_precision_policy or MixedPrecisionPolicy()
    fp32 = MixedPrecisionPolicy(
        param_dtype=None, reduce_dtype=policy.reduce_dtype, output_dtype=None, cast_forward_inputs=False
    )
    before = {id(param): (norm, name) for norm in norms for name, param in norm.named_parameters(recurse=False)}
    for norm in norms:
        fully_shard(
            norm, reshard_after_forward=plugin.reshard_after_forward, offload_policy=plugin.cpu_offload, mp_policy=fp32
        )
    for group in optimizer.param_groups:
        group["params"] = [getattr(*before[id(p)]) if id(p) in before else p for p in group["params"]]
    return (
        f"FSDP keeps the {len(norms)} normalisation layers with running statistics in fp32 under "
        f"{accelerator.mixed_precision}"
    )


def share_norm_statistics(accelerator, model: nn.Module) -> str | None:
    """After ``prepare`` under FSDP on several processes: the running statistics of normalisation layers (BatchNorm)
    are rank 0's on every process after each training forward, as DDP makes them (its buffer broadcast). FSDP leaves
    buffers alone, so each process would keep statistics of its own batches: a checkpoint (DCP keeps one copy of a
    replicated tensor) and the exported weights would hold one process's, and a resume would continue the others
    from them."""
    import torch.distributed as dist

    if accelerator.num_processes == 1:
        return None
    buffers = [
        buffer
        for module in model.modules()
        if _keeps_running_statistics(module)
        for buffer in module.buffers(recurse=False)
    ]
    if not buffers:
        return None

    def broadcast_from_rank_0(module, args, output):
        if module.training:
            for buffer in buffers:
                dist.broadcast(buffer, src=0)

    model.register_forward_hook(broadcast_from_rank_0)
    return "FSDP: the normalisation layers' running statistics are rank 0's on every process, as under DDP"


def _keeps_running_statistics(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats
