"""A user's own recipe in a few lines, used by the tests: a small conv net (BatchNorm optional) on
synthetic images. After training every process writes what it saw: its own final weights, how often
the optimizer stepped and zeroed its gradients, and the learning rate of each optimizer step."""

import errno
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from acceltrain import EMA, ClassificationTask, Hook, TrainConfig, fit, option, run_recipe
from acceltrain.vision import CropFlip, ImageClassification, synthetic_images


@dataclass
class TinyConfig(TrainConfig):
    plots: bool = option(  # drawing costs a second a launch: on only where tests/test_plots.py checks the picture
        False, "draw <output_dir>/curves.png when each launch ends", free_on_resume=True
    )
    num_train: int = option(96, "training samples")
    num_eval: int = option(37, "eval samples (odd on purpose: uneven last batch)")
    batchnorm: bool = option(False, "put a BatchNorm in the net")
    masked_loss: bool = option(False, "train on classes 0-4 only, as (loss sum, target count): like padded tokens")
    count_allreduce: bool = option(False, "count DDP gradient all-reduces (a comm hook) into rank<N>.json")
    ema_decay: float | None = option(None, "add the EMA hook with this decay (exported as model.safetensors)")
    die_at_step: int | None = option(
        None, "every process kills itself (SIGKILL) at this step, on torchrun's first attempt only"
    )
    wait_for_restarted_peer: bool = option(
        False, "ft-launch: replica 0, once alone after training with a peer, waits for the peer's restart to be ready"
    )
    sleep_per_step: float = option(
        0.0, "seconds to sleep after each optimizer step: a slow run to signal (the maths unchanged)"
    )
    stream: str | None = option(None, "train on the images as a stream", choices=("torch", "hf"))
    stream_drop: str = option(
        "0",
        "with --stream torch: comma list, by rank, of samples each process's stream leaves out at "
        "its end (a stream sharded unevenly across processes)",
    )


class ImageStream(torch.utils.data.IterableDataset):
    """The training images as a plain torch stream: augmented by (seed, pass, index), split across loader
    workers by index, no state of its own (the stateful loader fast-forwards it). The pass is shared memory,
    so that set_epoch reaches persistent workers."""

    def __init__(self, images: ImageClassification, drop: int = 0):
        self.images, self.length = images, len(images) - drop
        self.epoch = torch.zeros(1, dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self.epoch.fill_(epoch)

    def __iter__(self):
        worker = torch.utils.data.get_worker_info()
        start, step = (worker.id, worker.num_workers) if worker else (0, 1)
        epoch = int(self.epoch)
        for index in range(start, self.length, step):
            yield self.images.sample(index, epoch)


def hf_stream(images: ImageClassification, seed: int):
    """The same images as a Hugging Face streaming dataset (4 shards, shuffled per pass), stateful itself."""
    import datasets

    plain = datasets.Dataset.from_dict(
        {"image": [images[i][0].numpy() for i in range(len(images))], "label": images.labels.tolist()}
    )
    return plain.with_format("torch").to_iterable_dataset(num_shards=4).shuffle(seed=seed, buffer_size=16)


class RowsClassification(ClassificationTask):
    """Hugging Face rows batch as dicts: {"image": ..., "label": ...}."""

    def train_loss(self, model, batch):
        return super().train_loss(model, (batch["image"], batch["label"]))


def count_gradient_allreduces(counter: dict) -> None:
    """Instrument Accelerate's DDP wrap with a comm hook that counts bucket all-reduces."""
    import accelerate

    prepare_model = accelerate.Accelerator.prepare_model

    def counting_prepare_model(self, model, *args, **kwargs):
        wrapped = prepare_model(self, model, *args, **kwargs)
        if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def hook(state, bucket):
                counter["allreduces"] += 1
                return allreduce_hook(state, bucket)

            wrapped.register_comm_hook(None, hook)
        return wrapped

    accelerate.Accelerator.prepare_model = counting_prepare_model


class MaskedClassification(ClassificationTask):
    """Only samples of classes 0-4 are targets, so micro-batches hold different numbers of them."""

    def train_loss(self, model, batch):
        inputs, labels = batch
        mask = labels < 5
        losses = torch.nn.functional.cross_entropy(model(inputs), labels, reduction="none")
        return (losses * mask).sum(), mask.sum()


class DieAt(Hook):
    """A crash that torchrun's --max-restarts must recover from: SIGKILL at one step, on the first attempt."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, run):
        # the first attempt only: torchrun counts its restarts, Ray does not (a marker file per process)
        marker = run.output_dir / f".died-{os.environ.get('RANK', '0')}"
        if run.step == self.step and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)


READY_1 = {"event": "ready", "replica": 1}


class WaitForRestartedPeer(Hook):
    """Replica 0 of an ft-launch run does not train on alone before its killed peer is back (a `ready` event of
    replica 1 after its first): from then on the peer's quorum request holds the next quorum, whatever the speed of
    the machine, and the peer heals before the end."""

    def __init__(self):
        self.peers_seen, self.waited = 0, os.environ.get("ACCELTRAIN_FT_REPLICA", "0") != "0"

    def on_step_end(self, run):
        groups = run.engine.figures().get("replica_groups")
        self.peers_seen = max(self.peers_seen, groups or 0)
        if self.waited or self.peers_seen < 2 or groups != 1:
            return
        events = Path(os.environ["ACCELTRAIN_FT_EVENTS"])
        while len([e for e in map(json.loads, events.read_text().splitlines()) if e == {**e, **READY_1}]) < 2:
            time.sleep(0.1)
        self.waited = True


class SleepPerStep(Hook):
    """Slow steps, for a signal to land mid-run; in a requeued SLURM job at full speed (the signals came before)."""

    def __init__(self, seconds: float):
        self.seconds = seconds if os.environ.get("SLURM_RESTART_COUNT", "0") == "0" else 0.0

    def on_step_end(self, run):
        time.sleep(self.seconds)


class CountingSGD(torch.optim.SGD):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps = self.zero_grads = 0
        self.lrs = []

    def step(self, closure=None):
        self.steps += 1
        self.lrs.append(self.param_groups[0]["lr"])
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True):
        self.zero_grads += 1
        super().zero_grad(set_to_none)


def build_net(batchnorm: bool) -> nn.Module:
    layers = [nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8) if batchnorm else nn.Identity(), nn.ReLU()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


TASKS = Path("/proc/self/task")
# errnos of a thread that ended between the listing and the read: its folder is gone (ENOENT), or it is still
# listed but its task no longer exists (ESRCH: "No such process", seen in CI from reading .../comm)
VANISHED = (errno.ENOENT, errno.ESRCH)


def gloo_threads() -> list[str] | None:
    """The names of this process's gloo threads (Linux): a process group left alive after the run, None elsewhere.
    A thread that ends while they are listed (a loader worker's pin thread) is skipped, however its end shows."""
    if not TASKS.is_dir():
        return None
    names = []
    for task in TASKS.iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError as err:  # FileNotFoundError, ProcessLookupError, or a bare OSError with either errno
            if err.errno not in VANISHED:
                raise
    return sorted(name for name in names if "gloo" in name)


def main(cfg: TinyConfig, hooks=(), task=None) -> None:
    (train_images, train_labels), (eval_images, eval_labels) = synthetic_images(
        cfg.num_train, cfg.num_eval, seed=cfg.seed
    )
    classes = [str(i) for i in range(10)]
    train_set = ImageClassification(train_images, train_labels, classes, augment=CropFlip(), seed=cfg.seed)
    eval_set = ImageClassification(eval_images, eval_labels, classes)
    model = build_net(cfg.batchnorm)
    optimizer = CountingSGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    allreduce_counter = {"allreduces": 0}
    if cfg.count_allreduce:
        count_gradient_allreduces(allreduce_counter)
    task = task or (MaskedClassification() if cfg.masked_loss else ClassificationTask())
    if cfg.ema_decay is not None:
        hooks = [*hooks, EMA(decay=cfg.ema_decay)]
    if cfg.die_at_step is not None:
        hooks = [*hooks, DieAt(cfg.die_at_step)]
    if cfg.wait_for_restarted_peer:
        hooks = [*hooks, WaitForRestartedPeer()]
    if cfg.sleep_per_step:
        hooks = [*hooks, SleepPerStep(cfg.sleep_per_step)]
    if cfg.stream == "torch":
        drops = [int(n) for n in cfg.stream_drop.split(",")]
        train_set = ImageStream(train_set, drop=drops[min(int(os.environ.get("RANK", "0")), len(drops) - 1)])
    elif cfg.stream == "hf":
        train_set, task = hf_stream(train_set, cfg.seed), RowsClassification()
    summary = fit(cfg, model, optimizer, train_set, eval_set, task=task, hooks=hooks, name="tiny")
    rank = int(os.environ.get("RANK", "0"))
    out = Path(summary["config"]["output_dir"])
    weights = model.state_dict()
    if not any(
        hasattr(v, "full_tensor") for v in weights.values()
    ):  # FSDP's shards: model.safetensors holds them gathered
        save_file({k: v.contiguous() for k, v in weights.items()}, str(out / f"rank{rank}.safetensors"))
    counts = {
        "steps": optimizer.steps,
        "zero_grads": optimizer.zero_grads,
        "lrs": optimizer.lrs,
        "gloo_threads_after_fit": gloo_threads(),
        **allreduce_counter,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(counts))


if __name__ == "__main__":
    if os.environ.get("RANK", "0") == "0":  # a main process slower to start than the others (a race torchrun can lose)
        time.sleep(float(os.environ.get("TINY_MAIN_PROCESS_LAG_SECONDS", "0")))
    run_recipe(main, TinyConfig)
