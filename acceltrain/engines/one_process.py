"""One process: no process group, whole state dicts (the same checkpoints as DDP's, so each continues the other)."""

from __future__ import annotations

from accelerate.utils import DistributedType

from acceltrain.engines.base import Engine


class OneProcess(Engine):
    name = "one process"
    checkpoint_format = "DDP"
    distributed_types = (DistributedType.NO,)
