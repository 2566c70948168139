"""The training loop: one function, readable top to bottom, the same on a CPU, one GPU, N GPUs or nodes.

Gradient accumulation. ``Accelerator.accumulate`` syncs gradients every ``grad_accum`` micro-batches
and at the end of the epoch. When an epoch's batch count is not a multiple of ``grad_accum``, its last
window is shorter; each micro-batch loss is scaled by ``1 / window length`` (not ``1 / grad_accum``),
so every optimizer step, the last one included, applies the mean gradient of the samples it saw.

Learning rate. The schedule is counted in optimizer steps of this run: the loop steps the scheduler
once per optimizer step, on every process, whatever the process count and accumulation.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import torch
import yaml
from torch import nn
from torch.utils.data import Dataset

from . import __version__
from .checkpointing import METRICS_FILE, export_weights, resolve_output_dir, write_summary
from .config import ConfigError, TrainConfig
from .data import default_num_workers, eval_loader, train_loader
from .distributed import check_backend_honoured, convert_sync_batchnorm, init_process_state, use_cpu
from .metrics import EventLog, Throughput, peak_memory_mb
from .optim import build_scheduler
from .tasks import ClassificationTask
from .tracking import check_trackers_installed, start_tracking, tracker_names


def fit(
    cfg: TrainConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_set: Dataset,
    eval_set: Dataset | None = None,
    *,
    task=None,
    name: str = "run",
) -> dict:
    """Train ``model`` on ``train_set`` as ``cfg`` says; returns the summary also written to
    ``<output_dir>/summary.json``. ``task`` turns batches into losses and eval values (default:
    :class:`ClassificationTask`); ``name`` names the default output folder."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration
    from tqdm.auto import tqdm

    task = task or ClassificationTask()
    check_trackers_installed(cfg.report_to)
    init_process_state(cfg)
    output_dir = resolve_output_dir(cfg, name)
    accelerator = Accelerator(
        cpu=use_cpu(cfg.cpu),
        mixed_precision=cfg.mixed_precision,
        gradient_accumulation_steps=cfg.grad_accum,
        step_scheduler_with_optimizer=False,
        log_with=tracker_names(cfg.report_to) or None,
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / "logs")),
    )
    check_backend_honoured(accelerator.distributed_type)
    main = accelerator.is_main_process

    # ---- model and data on the devices Accelerate chose
    if cfg.sync_bn and accelerator.num_processes > 1:
        model = convert_sync_batchnorm(model, on_cpu=accelerator.device.type == "cpu")
    num_workers = default_num_workers() if cfg.num_workers is None else cfg.num_workers
    pin_memory = accelerator.device.type == "cuda"
    loaders = [train_loader(train_set, batch_size=cfg.batch_size, seed=cfg.seed, num_workers=num_workers, pin_memory=pin_memory)]
    if eval_set is not None:
        loaders.append(eval_loader(eval_set, batch_size=cfg.batch_size, num_workers=num_workers, pin_memory=pin_memory))
    model, optimizer, *loaders = accelerator.prepare(model, optimizer, *loaders)
    train_batches, eval_batches = loaders[0], (loaders[1] if eval_set is not None else None)

    batches_per_epoch = len(train_batches)
    global_batch = cfg.batch_size * accelerator.num_processes
    if batches_per_epoch == 0:
        raise ConfigError(
            f"--batch-size {cfg.batch_size} is too large: the {len(train_set)} training samples do not fill one "
            f"batch of {cfg.batch_size} on each of {accelerator.num_processes} processes"
        )
    steps_per_epoch = math.ceil(batches_per_epoch / cfg.grad_accum)
    total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))
    scheduler = accelerator.prepare(build_scheduler(getattr(optimizer, "optimizer", optimizer), cfg, total_steps))

    run_name = cfg.run_name or output_dir.name
    resolved = dataclasses.replace(cfg, output_dir=str(output_dir), mixed_precision=accelerator.mixed_precision, num_workers=num_workers)
    runtime = {
        "acceltrain": __version__,
        "torch": str(torch.__version__),
        "distributed_type": accelerator.distributed_type.value,
        "num_processes": accelerator.num_processes,
        "device": str(accelerator.device),
        "global_batch_size": global_batch * cfg.grad_accum,
        "steps_per_epoch": steps_per_epoch,
        "total_steps": total_steps,
    }
    if main:  # created only now: bad input found above leaves nothing behind
        output_dir.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.print(yaml.safe_dump({"config": resolved.to_dict(), "runtime": runtime}, sort_keys=False).rstrip())
    start_tracking(accelerator, cfg, run_name, {**resolved.to_dict(), "runtime": runtime})
    events = EventLog(output_dir / METRICS_FILE if main else None)

    # ---- train
    throughput = Throughput(accelerator.device, warmup_steps=min(cfg.timing_warmup_steps, total_steps - 1))
    progress = tqdm(total=total_steps, disable=not (main and cfg.progress), desc="train", dynamic_ncols=True)
    loss_sum = torch.zeros((), device=accelerator.device)
    loss_batches = 0
    step, epoch, samples_seen = 0, 0, 0
    train_loss = grad_norm = step_lr = None
    eval_metrics: dict[str, float] = {}
    time_to_target = None
    started = time.perf_counter()
    throughput.resume(step)

    while step < total_steps and time_to_target is None:
        train_batches.set_epoch(epoch)
        model.train()
        for batch_index, batch in enumerate(train_batches):
            window_start = batch_index - batch_index % cfg.grad_accum
            window = min(cfg.grad_accum, batches_per_epoch - window_start)
            with accelerator.accumulate(model):
                loss = task.train_loss(model, batch)
                accelerator.backward(loss * (cfg.grad_accum / window))
                if accelerator.sync_gradients:
                    if cfg.max_grad_norm is not None:
                        grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                    step_lr = scheduler.get_last_lr()[0]
                    optimizer.step()
                    if not accelerator.optimizer_step_was_skipped:
                        scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach().float()
            loss_batches += 1
            if not accelerator.sync_gradients:
                continue

            step += 1
            samples_seen += window * global_batch
            throughput.step_done(step, window * global_batch)
            progress.update(1)
            last_step = step == total_steps
            if step % cfg.log_every == 0 or last_step:
                totals = accelerator.reduce(torch.stack([loss_sum, torch.tensor(float(loss_batches), device=loss_sum.device)]), "sum")
                train_loss = (totals[0] / totals[1]).item()
                loss_sum.zero_()
                loss_batches = 0
                event = {
                    "step": step,
                    "epoch": round(epoch + (batch_index + 1) / batches_per_epoch, 4),
                    "loss": train_loss,
                    "lr": step_lr,
                    "samples_per_second": throughput.window_rate(),
                }
                if grad_norm is not None:
                    event["grad_norm"] = float(grad_norm)
                _log(accelerator, events, progress, event)
            epoch_ends = batch_index + 1 == batches_per_epoch
            eval_due = step % cfg.eval_every == 0 if cfg.eval_every else epoch_ends
            if eval_batches is not None and (eval_due or last_step):
                throughput.pause()
                eval_metrics, eval_samples = evaluate(accelerator, model, eval_batches, task)
                _log(accelerator, events, progress, {"step": step, **eval_metrics, "eval_samples": eval_samples})
                accuracy = eval_metrics.get("eval_accuracy")
                if cfg.target_accuracy is not None and accuracy is not None and accuracy >= cfg.target_accuracy:
                    time_to_target = time.perf_counter() - started
                    accelerator.print(f"reached eval accuracy {accuracy:.4f} >= {cfg.target_accuracy} in {time_to_target:.1f} s")
                    break
                model.train()
                throughput.resume(step)
            if last_step:
                break
        else:
            epoch += 1
    wall_seconds = time.perf_counter() - started
    progress.close()

    # ---- outputs
    weights_path = export_weights(accelerator, model, output_dir)
    summary = {
        "steps": step,
        "samples_seen": samples_seen,
        "epochs": round(samples_seen / (batches_per_epoch * global_batch), 4),
        "train_loss": train_loss,
        "eval_accuracy": eval_metrics.get("eval_accuracy"),
        "eval_loss": eval_metrics.get("eval_loss"),
        "samples_per_second": throughput.rate(),
        "timed_steps": throughput.timed_steps,
        "wall_seconds": wall_seconds,
        "time_to_target_seconds": time_to_target,
        "num_processes": accelerator.num_processes,
        "distributed_type": accelerator.distributed_type.value,
        "mixed_precision": accelerator.mixed_precision,
        "final_lr": scheduler.get_last_lr()[0],
        **peak_memory_mb(accelerator.device),
        "weights": str(weights_path),
        "runtime": runtime,
        "config": resolved.to_dict(),
    }
    if main:
        write_summary(output_dir, summary)
        accelerator.print(f"done: {step} steps, train loss {train_loss:.4f}, eval accuracy {summary['eval_accuracy']}, outputs in {output_dir}")
    events.close()
    accelerator.wait_for_everyone()
    accelerator.end_training()  # closes the trackers (and, in Accelerate >= 1.x, the process group)
    return summary


def evaluate(accelerator, model: nn.Module, batches, task) -> tuple[dict[str, float], int]:
    """Mean of each per-sample eval value over the whole eval set, exact across processes:
    ``gather_for_metrics`` drops the samples that even batches padded onto the last one."""
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    count = 0
    with torch.no_grad():
        for batch in batches:
            values = accelerator.gather_for_metrics(task.eval_values(model, batch))
            for key, value in values.items():
                sums[key] = sums.get(key, 0) + value.double().sum()
            count += len(next(iter(values.values())))
    return {f"eval_{key}": (total / count).item() for key, total in sums.items()}, count


def _log(accelerator, events: EventLog, progress, event: dict) -> None:
    events.write(event)
    accelerator.log({k: v for k, v in event.items() if k != "step" and v is not None}, step=event["step"])
    if accelerator.is_main_process:
        progress.write(" ".join(f"{k}={_fmt(v)}" for k, v in event.items()))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
