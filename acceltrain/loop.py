"""The training loop: one function, readable top to bottom, the same on a CPU, one GPU, N GPUs or nodes.

Gradient accumulation. ``Accelerator.accumulate`` syncs gradients every ``grad_accum`` micro-batches
and at the end of the epoch. When an epoch's batch count is not a multiple of ``grad_accum``, its last
window is shorter; each micro-batch loss is scaled by ``1 / window length`` (not ``1 / grad_accum``),
so every optimizer step, the last one included, applies the mean gradient of the samples it saw.

Token normalisation. A task whose ``train_loss`` returns ``(loss_sum, target_count)`` (a language model:
summed token losses and the number of target tokens) gets the gradient of the summed loss of the whole
window on all processes divided by its total target count: the same gradient as one big batch, however
the tokens fall across micro-batches and processes. The counts are all-reduced once per optimizer step.

Learning rate. The schedule is counted in optimizer steps of this run: the loop steps the scheduler
once per optimizer step, on every process, whatever the process count and accumulation.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import platform
import time
from pathlib import Path

import accelerate
import torch
import yaml
from torch import nn
from torch.utils.data import Dataset, default_collate

from . import __version__
from .checkpointing import (
    CHECKPOINTS_DIR,
    EXIT_PREEMPTED,
    METRICS_FILE,
    PreemptionSignals,
    TrainerState,
    checkpoint_dir,
    export_weights,
    find_resume_checkpoint,
    resolve_output_dir,
    rotate_checkpoints,
    save_checkpoint,
    write_summary,
)
from .config import ConfigError, TrainConfig
from .data import default_num_workers, eval_loader, train_loader
from .speed import (
    apply_batch_size,
    enable_activation_checkpointing,
    find_batch_size,
    peak_flops_per_device,
    to_channels_last,
    training_flops_per_sample,
)
from .distributed import check_backend_honoured, convert_sync_batchnorm, deepspeed_plugin, init_process_state, use_cpu
from .metrics import EventLog, Throughput, peak_memory_mb, synchronize
from .optim import build_scheduler
from .profiling import MemoryReport, StepProfiler
from .tasks import ClassificationTask
from .tracking import active_trackers, finish_tracking, start_tracking


TOKEN_NORMALISATION_UNDER_DEEPSPEED = (
    "a task returning (loss sum, target count) needs the gradients in param.grad to normalise them, and "
    "DeepSpeed keeps them in its partitions: use DDP or FSDP for this recipe"
)


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
    trackers = active_trackers(cfg)
    init_process_state(cfg)
    output_dir = resolve_output_dir(cfg, name)
    accelerator = Accelerator(
        cpu=use_cpu(cfg.cpu),
        mixed_precision=cfg.mixed_precision,
        gradient_accumulation_steps=cfg.grad_accum,
        deepspeed_plugin=deepspeed_plugin(cfg),
        log_with=trackers or None,
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / "logs")),
    )
    check_backend_honoured(accelerator.distributed_type)
    main = accelerator.is_main_process

    # ---- model and data on the devices Accelerate chose, with the speed flags applied
    torch_optimizer = optimizer  # the schedule drives its param groups, whatever Accelerate wraps it in
    cfg, model, optimizer, train_batches, eval_batches, flops_per_sample, notes = _prepare(
        cfg, accelerator, model, optimizer, train_set, eval_set, task
    )
    batches_per_epoch = len(train_batches)
    global_batch = cfg.batch_size * accelerator.num_processes
    if batches_per_epoch == 0:
        raise ConfigError(
            f"--batch-size {cfg.batch_size} is too large: the {len(train_set)} training samples do not fill one "
            f"batch of {cfg.batch_size} on each of {accelerator.num_processes} processes"
        )
    steps_per_epoch = math.ceil(batches_per_epoch / cfg.grad_accum)
    total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))
    # Not prepared: Accelerate would step it once per process (#1382) and, under DeepSpeed, leave it out
    # of checkpoints; its state travels in TrainerState instead.
    scheduler = build_scheduler(torch_optimizer, cfg, total_steps)

    run_name = cfg.run_name or output_dir.name
    resolved = dataclasses.replace(cfg, output_dir=str(output_dir), mixed_precision=accelerator.mixed_precision)
    peak_flops = peak_flops_per_device(accelerator.device, accelerator.mixed_precision, cfg.peak_tflops)
    runtime = {
        "acceltrain": __version__,
        "torch": str(torch.__version__),
        "accelerate": accelerate.__version__,
        "distributed_type": accelerator.distributed_type.value,
        "num_processes": accelerator.num_processes,
        "device": str(accelerator.device),
        "device_name": torch.cuda.get_device_name(accelerator.device) if accelerator.device.type == "cuda" else platform.processor() or "cpu",
        "global_batch_size": global_batch * cfg.grad_accum,
        "steps_per_epoch": steps_per_epoch,
        "total_steps": total_steps,
        "model_flops_per_sample": flops_per_sample,
        "peak_flops_per_device": peak_flops,
        **_backend_settings(accelerator),
    }
    if main:  # created only now: bad input found above leaves nothing behind
        output_dir.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.print(yaml.safe_dump({"config": resolved.to_dict(), "runtime": runtime}, sort_keys=False).rstrip())
    for note in notes:
        accelerator.print(note)

    # ---- resume: Accelerate restores model, optimizer, grad scaler, RNG; TrainerState the rest
    state = TrainerState(seed=cfg.seed, global_batch_size=global_batch, grad_accum=cfg.grad_accum, train_samples=len(train_set))
    if cfg.resume:
        state = _resume(accelerator, cfg.resume, output_dir, state)
        if state.scheduler:
            scheduler.load_state_dict(state.scheduler)
    state.tracker_run_id = start_tracking(
        accelerator, cfg, trackers, run_name=run_name, output_dir=output_dir,
        run_config={**resolved.to_dict(), "runtime": runtime}, resume_run_id=state.tracker_run_id,
    ) or state.tracker_run_id
    events = EventLog(output_dir / METRICS_FILE if main else None, keep_until_step=state.step)

    # ---- train
    checkpointing = bool(cfg.save_every_steps or cfg.save_every_minutes or cfg.keep_best or cfg.stop_after_steps)
    throughput = Throughput(accelerator.device, warmup_steps=min(cfg.timing_warmup_steps, total_steps - state.step - 1))
    progress = tqdm(total=total_steps, initial=state.step, disable=not (main and cfg.progress), desc="train", dynamic_ncols=True)
    loss_sum = torch.zeros((), device=accelerator.device)
    loss_batches = 0  # micro-batches, or loss targets (tokens) for a task that returns (sum, count)
    window_targets = 0
    step, epoch, samples_seen, launch_start_step = state.step, state.epoch, state.samples_seen, state.step
    skip_batches = state.batches_in_epoch
    train_loss = grad_norm = step_lr = None
    time_to_target = None
    started = time.perf_counter() - state.train_seconds
    last_save_time, last_saved_step = time.monotonic(), state.step if cfg.resume else None
    stop_signal = None
    skipped_steps = 0  # fp16 overflow: the grad scaler skipped the optimizer step
    first_step_seconds = None
    profiler = StepProfiler(cfg.profile_steps, output_dir, cfg.profile_with_stack, enabled=main)
    memory = MemoryReport(accelerator.device, enabled=cfg.memory_report and main)
    memory.mark("model on device")
    synchronize(accelerator.device)
    launch_started = time.perf_counter()
    throughput.resume(0)
    profiler.step_ended(step)

    signals = PreemptionSignals().install()  # until the outputs are written; see EXIT_PREEMPTED
    while step < total_steps and time_to_target is None and stop_signal is None:
        train_batches.set_epoch(epoch)
        batches = _skip(accelerator, train_batches, skip_batches) if skip_batches else train_batches
        model.train()
        for batch_index, batch in enumerate(_timed(batches, throughput), start=skip_batches):
            if cfg.channels_last:
                batch = to_channels_last(batch)
            window_start = batch_index - batch_index % cfg.grad_accum
            window = min(cfg.grad_accum, batches_per_epoch - window_start)
            with accelerator.accumulate(model):
                loss = task.train_loss(model, batch)
                memory.mark("first forward")
                if isinstance(loss, tuple):  # (sum of per-target losses, target count): see the module docstring
                    if accelerator.distributed_type.value == "DEEPSPEED":
                        raise ConfigError(TOKEN_NORMALISATION_UNDER_DEEPSPEED)
                    loss, count = loss
                    window_targets += count
                    accelerator.backward(loss)
                else:
                    count = 1.0
                    accelerator.backward(loss * (cfg.grad_accum / window))
                memory.mark("first backward")
                if accelerator.sync_gradients:
                    if isinstance(window_targets, torch.Tensor):
                        _divide_gradients(model, accelerator.reduce(window_targets, "sum") / (cfg.grad_accum * accelerator.num_processes))
                        window_targets = 0
                    if cfg.max_grad_norm is not None:
                        grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                    step_lr = scheduler.get_last_lr()[0]
                    optimizer.step()
                    if accelerator.optimizer_step_was_skipped:
                        skipped_steps += 1
                    else:
                        scheduler.step()
                    memory.mark("first optimizer step")
                    optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach().float()
            loss_batches += count
            if not accelerator.sync_gradients:
                continue

            # ---- an optimizer step is done: log, evaluate, checkpoint, maybe stop
            step += 1
            samples_seen += window * global_batch
            throughput.step_done(step - launch_start_step, window * global_batch)
            if first_step_seconds is None:
                synchronize(accelerator.device)
                first_step_seconds = time.perf_counter() - launch_started
                memory.write(output_dir, accelerator.print)
            profiler.step_ended(step)
            progress.update(1)
            last_step = step == total_steps
            epoch_ends = batch_index + 1 == batches_per_epoch
            if step % cfg.log_every == 0 or last_step:
                totals = accelerator.reduce(torch.stack([loss_sum, loss_sum.new_tensor(0.0) + loss_batches]), "sum")
                train_loss = (totals[0] / totals[1]).item()
                loss_sum.zero_()
                loss_batches = 0
                event = {
                    "step": step,
                    "epoch": round(epoch + (batch_index + 1) / batches_per_epoch, 4),
                    "loss": train_loss,
                    "lr": step_lr,
                    **_speed_figures(throughput.window(), task, flops_per_sample, peak_flops, accelerator.num_processes),
                    **peak_memory_mb(accelerator.device),
                }
                if grad_norm is not None:
                    event["grad_norm"] = float(grad_norm)
                if skipped_steps or accelerator.mixed_precision == "fp16":
                    event["skipped_steps"] = skipped_steps
                _log(accelerator, events, progress, event)

            save_now = bool(cfg.save_every_steps and step % cfg.save_every_steps == 0)
            eval_due = step % cfg.eval_every == 0 if cfg.eval_every else epoch_ends
            if eval_batches is not None and (eval_due or last_step):
                throughput.pause()
                eval_metrics, eval_samples = evaluate(accelerator, model, eval_batches, task)
                _log(accelerator, events, progress, {"step": step, **eval_metrics, "eval_samples": eval_samples,
                                                     "wall_seconds": round(time.perf_counter() - started, 3)})
                state.last_eval = eval_metrics
                if _improves(task, eval_metrics, state.best_metric):
                    state.best_metric = eval_metrics[f"eval_{task.primary_metric}"]
                    if cfg.keep_best:
                        state.best_checkpoint = checkpoint_dir(output_dir, step).name
                        save_now = True
                accuracy = eval_metrics.get("eval_accuracy")
                if cfg.target_accuracy is not None and accuracy is not None and accuracy >= cfg.target_accuracy:
                    time_to_target = time.perf_counter() - started
                    accelerator.print(f"reached eval accuracy {accuracy:.4f} >= {cfg.target_accuracy} in {time_to_target:.1f} s")
                model.train()
                if not last_step:
                    throughput.resume(step - launch_start_step)

            if accelerator.num_processes == 1:  # no collective (and no device sync) needed to agree
                stop_signal = signals.name
            else:
                if signals.received is not None:
                    accelerator.set_trigger()
                if accelerator.check_trigger():  # every process stops at this same step
                    stop_signal = signals.name or "signal on another process"
            launch_done = cfg.stop_after_steps is not None and step - launch_start_step >= cfg.stop_after_steps
            if cfg.save_every_minutes:
                save_now |= _minutes_passed(accelerator, last_save_time, cfg.save_every_minutes)
            if (save_now or stop_signal or launch_done) and not last_step:
                throughput.pause()
                state = dataclasses.replace(
                    state, step=step, samples_seen=samples_seen, train_seconds=time.perf_counter() - started,
                    epoch=epoch + 1 if epoch_ends else epoch, batches_in_epoch=0 if epoch_ends else batch_index + 1,
                    scheduler=scheduler.state_dict(),
                )
                _save(accelerator, state, output_dir, cfg)
                last_save_time, last_saved_step = time.monotonic(), step
                throughput.resume(step - launch_start_step)
            if stop_signal or launch_done:
                stop_signal = stop_signal or "stop_after_steps"
                break
            if last_step or time_to_target is not None:
                break
        else:
            epoch += 1
        skip_batches = 0
    wall_seconds = time.perf_counter() - started
    speed = _speed_figures(totals := throughput.totals(), task, flops_per_sample, peak_flops, accelerator.num_processes)
    progress.close()

    if stop_signal is not None:  # checkpointed above: close cleanly and tell the launcher to come back
        accelerator.print(f"stopped at step {step} ({stop_signal}); checkpoint saved; continue with --resume auto")
        events.close()
        accelerator.wait_for_everyone()
        accelerator.end_training()
        signals.ignore_further()
        raise SystemExit(EXIT_PREEMPTED)

    # ---- outputs
    if checkpointing and last_saved_step != step:
        state = dataclasses.replace(state, step=step, samples_seen=samples_seen, train_seconds=wall_seconds, epoch=epoch,
                                    batches_in_epoch=0, scheduler=scheduler.state_dict())
        _save(accelerator, state, output_dir, cfg)
    weights_path = export_weights(accelerator, model, output_dir)
    eval_metrics = state.last_eval
    summary = {
        "steps": step,
        "samples_seen": samples_seen,
        "epochs": round(samples_seen / (batches_per_epoch * global_batch), 4),
        "train_loss": train_loss,
        "eval_accuracy": eval_metrics.get("eval_accuracy"),
        "eval_loss": eval_metrics.get("eval_loss"),
        **eval_metrics,  # a task's own metrics too (eval_perplexity)
        **speed,
        "timed_steps": totals["timed_steps"],
        "first_step_seconds": first_step_seconds,
        "compile_seconds": _compile_seconds(cfg, first_step_seconds, totals["ms_per_step"]),
        "skipped_steps": skipped_steps,
        "wall_seconds": wall_seconds,
        "time_to_target_seconds": time_to_target,
        "resumed_from_step": launch_start_step if cfg.resume else None,
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
        metric = f"eval_{task.primary_metric}"
        accelerator.print(f"done: {step} steps, train loss {train_loss}, {metric} {summary.get(metric)}, outputs in {output_dir}")
    events.close()
    accelerator.wait_for_everyone()
    finish_tracking(accelerator, trackers, summary, weights_path, cfg.log_model, extra_files=profiler.files)  # also ends the process group
    signals.restore()
    return summary


def _prepare(cfg: TrainConfig, accelerator, model: nn.Module, optimizer, train_set, eval_set, task):
    """Apply the speed flags in the order they must happen, then ``Accelerator.prepare``: memory format
    and activation checkpointing change the module; the batch-size probe needs the final module on the
    device; FLOPs are counted before compilation; compilation happens before the DDP wrap."""
    notes = []
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if cfg.activation_checkpointing:
        notes.append(f"activation checkpointing: {enable_activation_checkpointing(model)}")
    if cfg.sync_bn and accelerator.num_processes > 1:
        model = convert_sync_batchnorm(model, on_cpu=accelerator.device.type == "cpu")
    if cfg.auto_batch_size:
        found = find_batch_size(accelerator, model, optimizer, task, train_set, start=cfg.batch_size)
        cfg, note = apply_batch_size(cfg, found, optimizer)
        accelerator.gradient_accumulation_steps = cfg.grad_accum
        notes.append(note)
    flops_per_sample = getattr(task, "flops_per_sample", None)
    if flops_per_sample is None:
        sample_batch = default_collate([train_set[i] for i in range(min(2, len(train_set)))])
        flops_per_sample = training_flops_per_sample(model, task, sample_batch)
    if cfg.compile:
        model.compile(mode=cfg.compile_mode)  # in place: no OptimizedModule wrapper, no `_orig_mod.` keys

    num_workers = default_num_workers() if cfg.num_workers is None else cfg.num_workers
    pin_memory = accelerator.device.type == "cuda" if cfg.pin_memory is None else cfg.pin_memory
    options = {"num_workers": num_workers, "pin_memory": pin_memory, "prefetch_factor": cfg.prefetch_factor}
    cfg = dataclasses.replace(cfg, num_workers=num_workers, pin_memory=pin_memory)
    loaders = [] if cfg.data_on_device else [train_loader(train_set, batch_size=cfg.batch_size, seed=cfg.seed, **options)]
    if cfg.data_on_device and isinstance(getattr(eval_set, "images", None), list):  # decode the eval files once too
        from .device_loader import decoded_images

        eval_set = copy.copy(eval_set)  # the recipe's dataset stays as it was
        eval_set.images = decoded_images(eval_set.images, eval_set.image_size, eval_set.cache_dir)
    if eval_set is not None:
        loaders.append(eval_loader(eval_set, batch_size=cfg.batch_size, **options))
    model, optimizer, *loaders = accelerator.prepare(model, optimizer, *loaders)
    if cfg.data_on_device:
        from .device_loader import DeviceImageLoader

        train_batches = DeviceImageLoader.from_dataset(
            train_set, batch_size=cfg.batch_size, seed=cfg.seed, device=accelerator.device,
            process_index=accelerator.process_index, num_processes=accelerator.num_processes,
            channels_last=cfg.channels_last, cache_dir=getattr(train_set, "cache_dir", None),
        )
        loaders.insert(0, train_batches)
    eval_batches = loaders[1] if eval_set is not None else None
    return cfg, model, optimizer, loaders[0], eval_batches, flops_per_sample, notes


def _backend_settings(accelerator) -> dict:
    """The resolved DeepSpeed JSON or FSDP plugin settings, for the start-up print and the run config."""
    if accelerator.distributed_type.value == "DEEPSPEED":
        return {"deepspeed_config": accelerator.state.deepspeed_plugin.deepspeed_config}
    if accelerator.distributed_type.value == "FSDP":
        plugin = accelerator.state.fsdp_plugin
        keys = ("fsdp_version", "reshard_after_forward", "state_dict_type", "auto_wrap_policy", "cpu_offload", "mixed_precision_policy")
        return {"fsdp": {key: str(getattr(plugin, key, None)) for key in keys}}
    return {}


def _skip(accelerator, batches, count: int):
    """The rest of the current epoch after ``count`` batches (exact mid-epoch resume). The on-device
    loader skips by itself; a prepared DataLoader through ``Accelerator.skip_first_batches``."""
    if hasattr(batches, "skip_first"):
        return batches.skip_first(count)
    return accelerator.skip_first_batches(batches, count)


def _timed(batches, throughput: Throughput):
    """Yield the batches, telling ``throughput`` how long the host waited for each."""
    iterator = iter(batches)
    while True:
        started = time.perf_counter()
        try:
            batch = next(iterator)
        except StopIteration:
            return
        throughput.add_data_wait(time.perf_counter() - started)
        yield batch


def _speed_figures(figures: dict, task, flops_per_sample: float | None, peak_flops: float | None, processes: int) -> dict:
    """samples/s, ms/step and data-wait fraction, plus tokens/s for tasks that count tokens, and model
    FLOP/s and MFU (against the peak of all devices) where the FLOPs and the device's peak are known."""
    rate = figures["samples_per_second"]
    out = {**figures}
    tokens_per_sample = getattr(task, "tokens_per_sample", None)
    if tokens_per_sample:
        out["tokens_per_second"] = rate * tokens_per_sample if rate else None
    if flops_per_sample and rate:
        out["model_tflops_per_second"] = rate * flops_per_sample / 1e12
        out["mfu"] = rate * flops_per_sample / (peak_flops * processes) if peak_flops else None
    return out


def _compile_seconds(cfg: TrainConfig, first_step_seconds: float | None, ms_per_step: float | None) -> float | None:
    """With --compile: the first step's time less a steady step's, i.e. what compilation cost."""
    if not cfg.compile or first_step_seconds is None:
        return None
    return max(0.0, first_step_seconds - (ms_per_step or 0.0) / 1000)


def _resume(accelerator, resume: str, output_dir: Path, current: TrainerState) -> TrainerState:
    """Find and verify the checkpoint on the main process, agree on it everywhere, load it."""
    from accelerate.utils import broadcast_object_list

    found = [None, None, None]  # path, state fields, error
    if accelerator.is_main_process:
        try:
            hit = find_resume_checkpoint(resume, output_dir, warn=lambda message: print(f"warning: {message}", flush=True))
            if hit is not None:
                found[:2] = [str(hit[0]), dataclasses.asdict(hit[1])]
        except ConfigError as err:
            found[2] = str(err)
    broadcast_object_list(found, from_process=0)
    path, fields, error = found
    if error:
        raise ConfigError(error)
    if path is None:
        accelerator.print(f"--resume auto: no complete checkpoint in {output_dir / CHECKPOINTS_DIR}; starting fresh")
        return current
    saved = TrainerState(**fields)
    saved.check_compatible(current, Path(path))
    accelerator.load_state(path)
    accelerator.print(f"resumed from {path} at step {saved.step} (epoch {saved.epoch}, {saved.batches_in_epoch} batches into it)")
    return saved


def _save(accelerator, state: TrainerState, output_dir: Path, cfg: TrainConfig) -> None:
    path = save_checkpoint(accelerator, state, output_dir)
    if accelerator.is_main_process:
        rotate_checkpoints(output_dir, cfg.keep_last, state.best_checkpoint)
    accelerator.wait_for_everyone()
    accelerator.print(f"checkpoint: {path}")


def _minutes_passed(accelerator, since: float, minutes: float) -> bool:
    """The main process's clock decides, so that every process saves at the same step."""
    from accelerate.utils import broadcast_object_list

    due = [time.monotonic() - since >= minutes * 60]
    broadcast_object_list(due, from_process=0)
    return bool(due[0])


def _improves(task, metrics: dict, best: float | None) -> bool:
    value = metrics.get(f"eval_{task.primary_metric}")
    if value is None:
        return False
    if best is None:
        return True
    return value > best if task.higher_is_better else value < best


def evaluate(accelerator, model: nn.Module, batches, task) -> tuple[dict[str, float], int]:
    """Each per-sample eval value summed over the whole eval set, exact across processes
    (``gather_for_metrics`` drops the samples that even batches padded onto the last one), then turned
    into metrics by ``task.eval_metrics(sums, samples)`` if the task has it, else into means."""
    model.eval()
    totals: dict[str, torch.Tensor] = {}
    count = 0
    with torch.no_grad():
        for batch in batches:
            values = accelerator.gather_for_metrics(task.eval_values(model, batch))
            for key, value in values.items():
                totals[key] = totals.get(key, 0) + value.double().sum()
            count += len(next(iter(values.values())))
    sums = {key: total.item() for key, total in totals.items()}
    summarise = getattr(task, "eval_metrics", None)
    metrics = summarise(sums, count) if summarise else {key: total / count for key, total in sums.items()}
    return {f"eval_{key}": value for key, value in metrics.items()}, count


def _divide_gradients(model: nn.Module, divisor: torch.Tensor) -> None:
    for param in model.parameters():
        if param.grad is not None:
            param.grad.div_(divisor.to(param.grad.dtype))


def _log(accelerator, events: EventLog, progress, event: dict) -> None:
    events.write(event)
    accelerator.log({k: v for k, v in event.items() if k != "step" and v is not None}, step=event["step"])
    if accelerator.is_main_process:
        progress.write(" ".join(f"{k}={_fmt(v)}" for k, v in event.items()))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
