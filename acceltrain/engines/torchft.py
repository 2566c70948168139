"""torchft: replica groups that heal from a live peer instead of restarting the job (meta-pytorch/torchft).

``acceltrain ft-launch`` starts torchft's Lighthouse and N replica groups of one process each. Each group is a
one-process Accelerate run (``DistributedType.NO``); torchft carries everything between groups:

- at each optimizer step's first micro-batch, a quorum of the groups alive now. It is synchronous, so that a group
  that heals does so at a step boundary, where a resume would: the model, optimizer, schedule, training state and
  hooks' states of a live peer (the pieces a checkpoint holds), then its loader skips to the peer's position;
- gradients averaged over the groups that take part, before clipping;
- the optimizer step only when the quorum commits; otherwise it reads as skipped, as an fp16 overflow does.

Each group reads its own shard of every epoch. Replica 0 writes the run folder and the checkpoints: in the other
groups Accelerate's ``process_index`` is the replica's, so every writer guarded by ``is_main_process`` is silent
there. The events a person or a test reads (``ft_events.jsonl``) come from here and from the launcher."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from datetime import timedelta

import torch
from accelerate.utils import DistributedType

from acceltrain.config.options import ConfigError
from acceltrain.engines.base import Engine

# What ft-launch tells each group
REPLICA, GROUPS, MIN_REPLICAS, EVENTS, RESTARTED = (
    "ACCELTRAIN_FT_REPLICA",
    "ACCELTRAIN_FT_GROUPS",
    "ACCELTRAIN_FT_MIN_REPLICAS",
    "ACCELTRAIN_FT_EVENTS",
    "ACCELTRAIN_FT_RESTARTED",
)
EVENTS_FILE = "ft_events.jsonl"


def require_torchft() -> None:
    """One line when torchft is missing, naming the extra that installs it."""
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise ConfigError(
            "acceltrain ft-launch needs torchft, which is not installed: pip install 'acceltrain[ft]'"
        ) from None


def record_event(path: str | os.PathLike | None, event: str, replica: int, **fields) -> None:
    """One line of ``ft_events.jsonl``: written whole in one append, so that groups and the launcher can share the
    file."""
    if not path:
        return
    line = json.dumps({"event": event, "replica": replica, "time": round(time.time(), 3), **fields}) + "\n"
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(descriptor, line.encode())
    finally:
        os.close(descriptor)


def weights_sha256(model: torch.nn.Module) -> str:
    """The model state's digest, by name in order: equal in two groups exactly when their weights are."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class TorchFT(Engine):
    name = "torchft"
    checkpoint_format = "DDP"  # whole state dicts: a torchft checkpoint continues under one process or DDP
    distributed_types = (DistributedType.NO,)  # each group is one process; torchft joins them
    launch_variable = "ACCELTRAIN_TORCHFT"
    refusals = {
        "async_checkpoint": "--async-checkpoint is not supported under acceltrain ft-launch: drop it (replica 0 "
        "writes each checkpoint while the other groups go on)",
        "data_on_device": "--data-on-device is not supported under acceltrain ft-launch: drop it (each replica group "
        "reads its shard through the loader)",
        "streams": "a training stream cannot be sharded across replica groups under acceltrain ft-launch: give a "
        "dataset with a length, or launch without ft-launch",
    }

    @classmethod
    def process_state_ready(cls, state) -> None:
        """Only replica 0 is the main process: the other groups write nothing to the run folder."""
        require_torchft()
        state.process_index = state.local_process_index = _replica()

    def __init__(self, accelerator):
        super().__init__(accelerator)
        self.replica, self.groups = _replica(), int(os.environ.get(GROUPS, "1"))
        self.events = os.environ.get(EVENTS)
        self.manager = None
        self._store = None
        self._served: Callable[[], dict] | None = None  # share_state's, for _connect (a restarted group: in join)
        self._healed: Callable[[dict], int] | None = None
        self._open = False  # a quorum stands for the step under way
        self._participants = None  # in the last quorum recorded
        self._heal: dict | None = None  # the last heal's source and time, until recorded

    # ---- the steps

    def data_shard(self) -> tuple[int, int]:
        return self.replica, self.groups

    def writes_checkpoints(self) -> bool:
        return self.replica == 0

    def share_state(self, state_dict: Callable[[], dict], load_state_dict: Callable[[dict], int]) -> None:
        """What this group will serve a peer that heals (``state_dict()``) and take when it heals itself
        (``load_state_dict``), and, at a launch's start, its torchft Manager: heartbeating while the groups set up,
        every group is known to the Lighthouse before any first quorum. A restarted group makes its Manager only in
        :meth:`join`: once it heartbeats, the Lighthouse holds the live groups' quorums for it, and they must not wait
        while it loads a checkpoint and sets up."""
        self._served, self._healed = state_dict, load_state_dict
        if os.environ.get(RESTARTED) != "1":
            self._connect()

    def join(self, step: int) -> None:
        """The first quorum, from ``step`` (0, or a resumed checkpoint's): the groups behind the most advanced one
        heal from it (torchft heals a group whose step is not the quorum's highest). At the launch's start every group
        waits for the others to be ready (at most a minute), so that they start together: a group that came late
        would heal into a later place of its shard, and the batches before it would go untrained."""
        if self.manager is None:  # a restarted group: share_state left the Manager to now
            self._connect()
        record_event(self.events, "ready", self.replica)  # from `started`: the group's start-up; to `healed`: the heal
        deadline = time.monotonic() + 60
        while self.events and time.monotonic() < deadline and len(_ready(self.events)) < self.groups:
            time.sleep(0.05)  # (a restarted group finds its peers ready: it does not wait)
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        self.start_step(step)

    def _connect(self) -> None:
        """This group's store, its process group and torchft's Manager, joined to the Lighthouse."""
        import torchft
        from torch.distributed import TCPStore

        replica, state_dict, load_state_dict = self.replica, self._served, self._healed

        def served() -> dict:
            return {"replica": replica, "state": state_dict()}

        def healed(state: dict) -> None:
            self._heal = {"step": load_state_dict(state["state"]), "from_replica": state["replica"]}

        timeout = timedelta(seconds=float(os.environ.get("TORCHFT_TIMEOUT_SEC", "30")))
        self._store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.manager = torchft.Manager(
            pg=torchft.ProcessGroupGloo(timeout=timeout),
            load_state_dict=healed,
            state_dict=served,
            min_replica_size=int(os.environ.get(MIN_REPLICAS, "1")),
            use_async_quorum=False,
            replica_id=f"replica_{replica:04d}",  # torchft orders groups by this string
            store_addr="127.0.0.1",
            store_port=self._store.port,  # never 0: torchft would read $MASTER_PORT instead
            rank=0,
            world_size=1,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=120),
            connect_timeout=timeout,
        )

    def start_step(self, step: int) -> None:
        """The step's quorum, once per step (its first micro-batch may come right after :meth:`join`)."""
        if self._open:
            return
        started = time.perf_counter()
        self.manager.start_quorum()
        self._open = True
        if self._heal is not None:
            seconds = round(time.perf_counter() - started, 3)
            record_event(self.events, "healed", self.replica, seconds=seconds, **self._heal)
            step, self._heal = self._heal["step"], None
        participants = self.manager.num_participants()
        if participants != self._participants:
            record_event(self.events, "quorum", self.replica, step=step, participants=participants)
            self._participants = participants

    def average_gradients(self, model) -> None:
        """The mean gradient over the groups in the quorum (a group that lacks a gradient adds zeros), and the mean
        of the floating-point buffers (BatchNorm's statistics, which each group gathers on its own shard: DDP copies
        rank 0's), so that the groups' models stay equal; one all-reduce per dtype."""
        params = [param for param in model.parameters() if param.requires_grad]
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        tensors = [param.grad for param in params] + [
            buffer for buffer in model.buffers() if buffer.is_floating_point()
        ]
        for dtype in dict.fromkeys(tensor.dtype for tensor in tensors):
            same = [tensor for tensor in tensors if tensor.dtype == dtype]
            flat = torch.cat([tensor.reshape(-1) for tensor in same])
            self.manager.allreduce(flat).wait()
            offset = 0
            for tensor in same:
                tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()

    def step_optimizer(self, optimizer) -> bool:
        """The step, only when the quorum commits it (every group of it agrees it is sound)."""
        self._open = False
        if not self.manager.should_commit():
            return False
        return super().step_optimizer(optimizer)

    def figures(self) -> dict:
        return {"replica_groups": self._participants}

    def training_ended(self, model, step: int) -> None:
        record_event(
            self.events,
            "finished",
            self.replica,
            step=step,
            weights_sha256=weights_sha256(self.accelerator.unwrap_model(model)),
        )

    def release(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None


def _ready(events: str) -> set[int]:
    """The replicas whose latest start is ready (the file may hold an earlier launch's events)."""
    ready = {}
    with open(events) as lines:
        for row in map(json.loads, lines):
            if row["event"] in ("started", "ready"):
                ready[row["replica"]] = row["event"] == "ready"
    return {replica for replica, is_ready in ready.items() if is_ready}


def _replica() -> int:
    return int(os.environ.get(REPLICA, "0"))
