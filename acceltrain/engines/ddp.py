"""DDP: every process holds the whole model and optimizer; the gradients are averaged at each optimizer step (on CPU
processes over gloo, on GPUs over NCCL). Whole state dicts, written by the main process; a checkpoint continues on
another process count."""

from __future__ import annotations

from accelerate.utils import DistributedType

from acceltrain.engines.base import Engine


class DDP(Engine):
    name = "DDP"
    checkpoint_format = "DDP"
    distributed_types = tuple(
        member for member in DistributedType if member.name.startswith("MULTI_")
    )  # MULTI_CPU, MULTI_GPU, and Accelerate's other device families
