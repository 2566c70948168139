"""The training loop: a short core, the same on a CPU, one GPU, N GPUs or nodes. Everything optional
(logging, evaluation, checkpoints, preemption, profiling, trackers, your own) is a hook that the core
calls at fixed points (:mod:`acceltrain.hooks`).

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

import dataclasses
import math
import platform
from pathlib import Path

import accelerate
import torch
import yaml
from accelerate.logging import get_logger
from accelerate.utils import DistributedType
from safetensors import SafetensorError
from torch import nn
from torch.utils.data import Dataset, default_collate

from . import __version__
from .checkpointing import (
    CHECKPOINTS_DIR,
    SUMMARY_FILE,
    CheckpointError,
    RunState,
    StoppedToResume,
    check_loadable_without_code,
    check_scheduler_state,
    checkpoint_engine,
    find_resume_checkpoint,
    finished_steps,
    loading_without_code,
    lock_output_dir,
    unlock_output_dir,
    write_summary,
)
from .config import TrainConfig, run_changes
from .data import default_num_workers, eval_loader, stop_workers, train_loader
from .distributed import ENGINES, check_backend_honoured, convert_sync_batchnorm, deepspeed_plugin, main_process_only, use_cpu
from .eval_subset import eval_subset
from .export import export_weights
from .lora import checkpoint_trainable_only, trainable_only_load
from .hooks import Hooks, builtin_hooks
from .logs import set_log_level
from .metrics import peak_memory_mb
from .optim import ScheduleProgress, build_scheduler
from .options import ConfigError, first_line, parse_json
from .run import TOKEN_NORMALISATION_UNDER_DEEPSPEED, Run, left_as_found_unless_trained, setup_run
from .sharding import build_accelerator, choose_wrap_policy, guard_gradient_average, parameter_counts
from .speed import apply_batch_size, enable_activation_checkpointing, find_batch_size, peak_flops_per_device, training_flops_per_sample
from .streams import check_stream, first_samples, is_stream, stream_loader
from .tasks import ClassificationTask, check_task
from .tracking import active_trackers

logger = get_logger(__name__)


def fit(cfg: TrainConfig, model: nn.Module, optimizer: torch.optim.Optimizer, train_set: Dataset,
        eval_set: Dataset | None = None, *, task=None, hooks=(), name: str = "run", collate_fn=None) -> dict:
    """Train ``model`` on ``train_set`` as ``cfg`` says; returns the summary also written to
    ``<output_dir>/summary.json``. ``task`` turns batches into losses and eval values (default:
    :class:`ClassificationTask`; see :class:`acceltrain.Task`); ``hooks`` are your own
    :class:`acceltrain.Hook` objects, run before the built-in ones; ``name`` names the default output folder;
    ``collate_fn`` makes each batch of samples, training and eval (default: torch's ``default_collate``; padding
    per batch: ``transformers.DataCollatorWithPadding(tokenizer)``)."""
    from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, ProjectConfiguration

    set_log_level(cfg.log_level)  # run_recipe did; code that calls fit() directly has not
    cfg.validate()  # likewise: a config built in code has not been checked
    task = ClassificationTask() if task is None else task
    check_task(task, evaluates=eval_set is not None)
    cfg = _resolve_target(cfg, task)
    stream = is_stream(train_set)
    if stream:
        check_stream(cfg, train_set, eval_set)
    trackers = active_trackers(cfg)
    setup = setup_run(cfg, name, task)
    cfg, output_dir, run = setup.cfg, setup.output_dir, None
    with left_as_found_unless_trained(setup, lambda: run is not None and run.throughput is not None):
        accelerator = build_accelerator(
            use_cpu(cfg.cpu), mixed_precision=cfg.mixed_precision, deepspeed_plugin=deepspeed_plugin(cfg),
            # a stream's windows run across its passes' ends, and its loader's position is checkpointed (streams.py)
            gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=cfg.grad_accum, sync_with_dataloader=not stream),
            dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stream, dispatch_batches=False if stream else None),
            log_with=trackers or None,
            project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / "logs")),
        )
        check_backend_honoured(accelerator.distributed_type)
        run, notes = _prepare(cfg, accelerator, model, optimizer, train_set, eval_set, task, collate_fn)
        notes.append(checkpoint_trainable_only(accelerator, run.model))
        run_config = {**run.cfg.to_dict(), "runtime": run.runtime}
        run._hooks = Hooks(hooks, builtin_hooks(run.cfg, evaluates=eval_set is not None, trackers=trackers, run_config=run_config))
        main_process_only(lambda: lock_output_dir(output_dir))  # one live run per folder
        logger.info(yaml.safe_dump({"config": run.cfg.to_dict(), "runtime": run.runtime}, sort_keys=False).rstrip())
        for note in filter(None, notes):
            logger.info(note)
        try:
            if cfg.resume and not _resume(run, cfg.resume):
                return _already_finished(run)
            run._hooks.call("on_fit_start", run)
            try:
                run._hooks.check_states()
                run._start_clock()
                _train(run)
                return _finish(run)
            except Exception as error:  # not SystemExit: a stop to be resumed keeps its handlers to the end
                run._hooks.call("on_exception", run, error)
                raise
        finally:
            stop_workers(run._train_batches, run.eval_batches)
            unlock_output_dir(output_dir)


def _train(run: Run) -> None:
    """The hot path: micro-batches, accumulation and the optimizer step; after each optimizer step the hooks,
    then one agreement on whether to save or stop."""
    accelerator, model, hooks = run.accelerator, run.model, run._hooks
    while run.step < run.total_steps:
        hooks.call("on_epoch_start", run)
        model.train()
        for batch in run._epoch_batches():
            opens, window = run._window()
            if opens:
                hooks.call("on_step_start", run)
            with accelerator.accumulate(model):
                loss, count = _backward(run, batch, window)
                if accelerator.sync_gradients:
                    _optimizer_step(run)
            run._loss_sum += loss.detach().float()
            run._loss_count += count
            if not accelerator.sync_gradients:
                continue
            run._step_done(window)
            hooks.call("on_step_end", run)
            if run._epoch_ended():
                hooks.call("on_epoch_end", run)
            save, stop = run._agree()
            if run.step == run.total_steps:
                return  # a stop asked for on the last step simply finishes the run
            if save or (stop and not stop.finish):
                run._save()
            if stop:
                run._stop = stop
                return
        if run._stream:
            _end_stream_pass(run)


def _backward(run: Run, batch, window: int) -> tuple[torch.Tensor, float | torch.Tensor]:
    """The micro-batch's loss and its weight in the logged mean, backpropagated: a mean loss scaled by
    ``grad_accum / window`` (see the module docstring); a ``(loss sum, target count)`` summed, its count kept
    for :func:`_optimizer_step` to normalise by."""
    loss = run.task.train_loss(run.model, batch)
    if not isinstance(loss, tuple):
        run.accelerator.backward(loss * (run.cfg.grad_accum / window))
        return loss, 1.0
    if run.accelerator.distributed_type == DistributedType.DEEPSPEED:  # a task that did not say sums_losses
        raise ConfigError(TOKEN_NORMALISATION_UNDER_DEEPSPEED)
    loss, count = loss
    run._window_targets += count
    run.accelerator.backward(loss)
    return loss, count


def _optimizer_step(run: Run) -> None:
    """The end of a window: normalise summed losses' gradients by the window's target count on all
    processes, unscale and clip, ``on_before_optimizer_step``, then step (a grad-scaler skip leaves the
    schedule where it is)."""
    accelerator = run.accelerator
    if isinstance(run._window_targets, torch.Tensor):
        targets = accelerator.reduce(run._window_targets, "sum")
        _divide_gradients(run.model, targets / (run.cfg.grad_accum * accelerator.num_processes))
        run._window_targets = 0
    _unscale_and_clip(run)
    run._lr = run.scheduler.get_last_lr()[0]
    run._hooks.call("on_before_optimizer_step", run)
    run.optimizer.step()
    if accelerator.optimizer_step_was_skipped:
        run._skipped_steps += 1
    else:
        run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)


def _end_stream_pass(run: Run) -> None:
    """A stream's pass ends where the stream does, maybe inside a window (else ``on_epoch_end`` has fired)."""
    if not run.batch_in_epoch:
        raise ConfigError(f"the training stream yielded no batch of {run.cfg.batch_size} per process in pass "
                          f"{run.epoch}: it holds fewer samples than one batch on each of {run.accelerator.num_processes} processes")
    if not run.accelerator.sync_gradients:
        run._hooks.call("on_epoch_end", run)
    run._next_pass()


def _unscale_and_clip(run: Run) -> None:
    """What ``on_before_optimizer_step`` sees are the true gradients: unscaled under fp16 (clip_grad_norm_
    unscales first) and clipped by ``--max-grad-norm``, with their norm before clipping in ``run.grad_norm``."""
    if run.cfg.max_grad_norm is None:
        run.accelerator.unscale_gradients()  # a no-op but under fp16
    else:
        run._grad_norm = run.accelerator.clip_grad_norm_(run.model.parameters(), run.cfg.max_grad_norm)


def _finish(run: Run) -> dict:
    """A stop to be resumed exits 75 (checkpointed in the loop); a finished run writes its outputs."""
    accelerator = run.accelerator
    run.throughput.pause()
    wall_seconds = run.elapsed()
    run._hooks.call("on_train_end", run)
    if run.stop is not None and not run.stop.finish:
        run._wait_for_checkpoint()
        logger.info(f"stopped at step {run.step} ({run.stop.reason}); checkpoint saved; continue with --resume auto")
        accelerator.wait_for_everyone()
        accelerator.end_training()
        raise StoppedToResume(run.stop.exit_code, run.step, run.stop.reason)
    save, _ = run._agree()
    if save and run._last_saved_step != run.step:
        run._save()
    run._wait_for_checkpoint()
    weights = export_weights(accelerator, run.model, run.output_dir, run._export)
    summary = _summary(run, weights, wall_seconds)
    run._hooks.call("on_fit_end", run, summary)
    if accelerator.is_main_process:
        write_summary(run.output_dir, summary)
        metric = f"eval_{getattr(run.task, 'primary_metric', 'loss')}"
        stopped = f" (stopped: {summary['stop_reason']})" if summary["stop_reason"] else ""
        logger.info(f"done: {run.step} steps{stopped}, train loss {summary['train_loss']}, {metric} {summary.get(metric)}, "
                    f"outputs in {run.output_dir}")
    accelerator.wait_for_everyone()
    accelerator.end_training()  # trackers, then the process group
    return summary


def _already_finished(run: Run) -> dict:
    """``--resume`` of a run that has finished at its newest checkpoint: nothing to train, nothing rewritten."""
    summary = parse_json((run.output_dir / SUMMARY_FILE).read_text())
    logger.info(f"the run in {run.output_dir} already finished at step {summary['steps']}; nothing to do")
    run.accelerator.end_training()
    return summary


def _summary(run: Run, weights: Path, wall_seconds: float) -> dict:
    """The run's record; hooks add their own entries (speed figures, time to target) in ``on_fit_end``."""
    eval_metrics = run.last_eval
    return {
        "steps": run.step,
        "stop_reason": run.stop.reason if run.stop is not None else None,  # None: it ran to its last step
        "samples_seen": run.samples_seen,
        "epochs": run.epoch_progress if run._stream else round(run.samples_seen / (run.batches_per_epoch * run._global_batch_size), 4),
        "train_loss": run._final_train_loss(),
        "eval_accuracy": eval_metrics.get("eval_accuracy"),
        "eval_loss": eval_metrics.get("eval_loss"),
        **eval_metrics,  # a task's own metrics too (eval_perplexity)
        "skipped_steps": run.skipped_steps,
        "checkpoint_seconds": round(run._checkpoint_seconds, 4),  # this launch's time blocked by saves
        "wall_seconds": wall_seconds,
        "resumed_from_step": run._resumed_from_step,
        "num_processes": run.accelerator.num_processes,
        "distributed_type": run.accelerator.distributed_type.value,
        "mixed_precision": run.accelerator.mixed_precision,
        "final_lr": run.scheduler.get_last_lr()[0],
        **peak_memory_mb(run.accelerator.device),
        "weights": str(weights),
        **({"config_changes": run._state.config_changes} if run._state.config_changes else {}),
        "runtime": run.runtime,
        "config": run.cfg.to_dict(),
    }


def _resolve_target(cfg: TrainConfig, task) -> TrainConfig:
    """``--target-accuracy`` is ``--target-metric`` for a task whose primary metric is accuracy."""
    if cfg.target_accuracy is None:
        return cfg
    primary = getattr(task, "primary_metric", None)
    if primary != "accuracy":
        raise ConfigError(
            f"--target-accuracy {cfg.target_accuracy} needs a task whose primary metric is accuracy; "
            f"{type(task).__name__}'s is {primary!r}: use --target-metric"
        )
    return dataclasses.replace(cfg, target_metric=cfg.target_accuracy, target_accuracy=None)


def _prepare(cfg: TrainConfig, accelerator, model: nn.Module, optimizer, train_set, eval_set, task, collate_fn) -> tuple[Run, list[str]]:
    """The speed flags, the loaders, ``Accelerator.prepare``, the plan in optimizer steps and the schedule:
    the run, and notes for the log."""
    collate_fn = collate_fn or default_collate
    cfg, model, flops_per_sample, notes = _apply_speed_flags(cfg, accelerator, model, optimizer, train_set, task, collate_fn)
    cfg, loaders, eval_set = _loaders(cfg, accelerator, train_set, eval_set, collate_fn)
    notes.append(choose_wrap_policy(accelerator, model))
    prepared_model, prepared_optimizer, *loaders = accelerator.prepare(model, optimizer, *loaders)
    notes.append(guard_gradient_average(accelerator, prepared_model))
    if cfg.data_on_device:
        loaders.insert(0, train_set.device_loader(
            batch_size=cfg.batch_size, seed=cfg.seed, device=accelerator.device, process_index=accelerator.process_index,
            num_processes=accelerator.num_processes, channels_last=cfg.channels_last,
        ))
    stream = is_stream(train_set)
    batches_per_epoch = 0 if stream else len(loaders[0])  # a stream's passes end when they end
    if batches_per_epoch == 0 and not stream:
        raise ConfigError(
            f"--batch-size {cfg.batch_size} is too large: the {len(train_set)} training samples do not fill one "
            f"batch of {cfg.batch_size} on each of {accelerator.num_processes} processes"
        )
    steps_per_epoch = None if stream else math.ceil(batches_per_epoch / cfg.grad_accum)
    total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))  # a stream has max_steps
    # Not prepared: Accelerate would step it once per process (#1382) and, under DeepSpeed, leave it out
    # of checkpoints; its state travels in the RunState instead. It drives the torch optimizer's param groups.
    schedule_progress = ScheduleProgress()
    scheduler = build_scheduler(optimizer, cfg, total_steps, schedule_progress)
    peak_flops = peak_flops_per_device(accelerator.device, accelerator.mixed_precision, cfg.peak_tflops)
    runtime = _runtime(cfg, accelerator, steps_per_epoch=steps_per_epoch, total_steps=total_steps,
                       model_flops_per_sample=flops_per_sample, peak_flops_per_device=peak_flops, **parameter_counts(prepared_model))
    run = Run(cfg=cfg, accelerator=accelerator, model=prepared_model, optimizer=prepared_optimizer, scheduler=scheduler,
              schedule_progress=schedule_progress,
              task=task, train_batches=loaders[0], eval_batches=loaders[1] if eval_set is not None else None,
              output_dir=Path(cfg.output_dir), total_steps=total_steps, batches_per_epoch=batches_per_epoch,
              train_samples=0 if stream else len(train_set), data_fingerprint=_data_fingerprint(train_set),
              flops_per_sample=flops_per_sample, peak_flops=peak_flops, runtime=runtime)
    return run, notes


def _data_fingerprint(train_set) -> str | None:
    """The training set's ``fingerprint`` attribute, if it has one: a string that changes with its content, recorded
    in each checkpoint so that a resume refuses other data (a stream has no length to compare)."""
    fingerprint = getattr(train_set, "fingerprint", None)
    if fingerprint is not None and not isinstance(fingerprint, str):
        raise ConfigError(f"the training set's fingerprint is a {type(fingerprint).__name__}: it must be a string (or absent)")
    return fingerprint


def _apply_speed_flags(cfg: TrainConfig, accelerator, model: nn.Module, optimizer, train_set, task, collate_fn):
    """The speed flags in the order they must happen: FLOPs are counted on the model as given (activation
    checkpointing would add its recomputed forward); memory format and activation checkpointing change the
    module; the batch-size probe needs the final module on the device; compilation happens before the DDP
    wrap. Returns the config (a found batch size), the model, its training FLOPs per sample and notes."""
    notes = []
    flops_per_sample = getattr(task, "flops_per_sample", None)
    if flops_per_sample is None:
        sample_batch = collate_fn(first_samples(train_set, 2))
        flops_per_sample = training_flops_per_sample(model, task, sample_batch)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if cfg.activation_checkpointing:
        notes.append(f"activation checkpointing: {enable_activation_checkpointing(model)}")
    if cfg.sync_bn and accelerator.num_processes > 1:
        model = convert_sync_batchnorm(model, on_cpu=accelerator.device.type == "cpu")
    if cfg.auto_batch_size:
        found = find_batch_size(accelerator, model, optimizer, task, train_set, start=cfg.batch_size, collate_fn=collate_fn)
        cfg, note = apply_batch_size(cfg, found, optimizer)
        accelerator.gradient_accumulation_steps = cfg.grad_accum
        notes.append(note)
    if cfg.compile:
        model.compile(mode=cfg.compile_mode)  # in place: no OptimizedModule wrapper, no `_orig_mod.` keys
    return cfg, model, flops_per_sample, notes


def _loaders(cfg: TrainConfig, accelerator, train_set, eval_set, collate_fn):
    """The loaders for ``Accelerator.prepare`` (none for training with ``--data-on-device``: the dataset's own
    loader comes after), with the loader options resolved into the config; the eval set as evaluated."""
    num_workers = default_num_workers() if cfg.num_workers is None else cfg.num_workers
    pin_memory = accelerator.device.type == "cuda" if cfg.pin_memory is None else cfg.pin_memory
    options = {"num_workers": num_workers, "pin_memory": pin_memory, "prefetch_factor": cfg.prefetch_factor, "collate_fn": collate_fn}
    cfg = dataclasses.replace(cfg, num_workers=num_workers, pin_memory=pin_memory, mixed_precision=accelerator.mixed_precision)
    if cfg.data_on_device:
        if not hasattr(train_set, "device_loader"):
            raise ConfigError(
                f"--data-on-device needs a dataset with a device_loader() method (acceltrain.vision.ImageClassification "
                f"has one); {type(train_set).__name__} has none"
            )
        eval_set = eval_set.decoded() if hasattr(eval_set, "decoded") else eval_set  # decode eval files once too
    if is_stream(train_set):
        loaders = [stream_loader(train_set, batch_size=cfg.batch_size, **options)]
    else:
        loaders = [] if cfg.data_on_device else [train_loader(train_set, batch_size=cfg.batch_size, seed=cfg.seed, **options)]
    if cfg.eval_samples is not None:
        if eval_set is None:
            raise ConfigError(f"--eval-samples {cfg.eval_samples} needs an eval set, and this recipe passes none to fit()")
        eval_set = eval_subset(eval_set, cfg.eval_samples, cfg.seed)
    if eval_set is not None:
        loaders.append(eval_loader(eval_set, batch_size=cfg.batch_size, **options))
    return cfg, loaders, eval_set


def _runtime(cfg: TrainConfig, accelerator, **plan) -> dict:
    """What this launch runs on, for the start-up print, the run config and the summary."""
    device = accelerator.device
    return {
        "acceltrain": __version__,
        "torch": str(torch.__version__),
        "accelerate": accelerate.__version__,
        "distributed_type": accelerator.distributed_type.value,
        "num_processes": accelerator.num_processes,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "global_batch_size": cfg.batch_size * accelerator.num_processes * cfg.grad_accum,
        **plan,
        **_backend_settings(accelerator),
    }


def _backend_settings(accelerator) -> dict:
    """The resolved DeepSpeed JSON or FSDP plugin settings, for the start-up print and the run config."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return {"deepspeed_config": accelerator.state.deepspeed_plugin.deepspeed_config}
    if accelerator.distributed_type == DistributedType.FSDP:
        plugin = accelerator.state.fsdp_plugin
        keys = ("fsdp_version", "reshard_after_forward", "state_dict_type", "auto_wrap_policy", "cpu_offload", "mixed_precision_policy")
        return {"fsdp": {key: str(getattr(plugin, key, None)) for key in keys}}
    return {}


def _resume(run: Run, resume: str) -> bool:
    """Find and verify the checkpoint on the main process, agree on it everywhere, check it continues this run,
    load it: Accelerate restores model, optimizer, grad scaler and RNG; the run its RunState; the hooks
    their states. False when the run in the folder finished at that checkpoint: nothing to do."""
    from accelerate.utils import broadcast_object_list

    accelerator = run.accelerator
    found = [None, None, None, None]  # path, state fields, hook states kept in them, error
    if accelerator.is_main_process:
        try:
            hit = find_resume_checkpoint(resume, run.output_dir, warn=logger.warning)
            if hit is not None:
                found[:3] = [str(hit[0]), dataclasses.asdict(hit[1]), hit[2]]
        except ConfigError as err:
            found[3] = str(err)
    broadcast_object_list(found, from_process=0)
    path, fields, kept_in_state, error = found
    if error:
        raise ConfigError(error)
    finished = finished_steps(run.output_dir)
    if path is None:
        if finished is not None:
            raise ConfigError(f"--output-dir {str(run.output_dir)!r} holds a finished run but no checkpoint to resume: use --overwrite to replace it")
        logger.info(f"--resume auto: no complete checkpoint in {run.output_dir / CHECKPOINTS_DIR}; starting fresh")
        return True
    saved = RunState(**fields)
    _check_engine(accelerator, path)
    current = RunState(**run._layout())
    saved.check_compatible(current, Path(path))
    relayout = saved.relayout(current)
    if relayout:
        _check_relayout_supported(accelerator, saved, current, path)
    changes = run_changes(saved.config, run.cfg, layout_free=relayout)
    if finished is not None:
        if saved.step >= finished and not changes:
            return False
        raise ConfigError(
            f"--output-dir {str(run.output_dir)!r} holds a finished run ({finished} steps): resuming the checkpoint of "
            f"step {saved.step} there would overwrite it; give another --output-dir to continue from that checkpoint into it"
        )
    described = ", ".join(f"{name} {old} -> {new}" for name, (old, new) in changes.items())
    if changes and not run.cfg.allow_config_change:
        raise ConfigError(
            f"checkpoint {path!r} was written with other settings: {described}; resume with the same settings, "
            "or pass --allow-config-change to apply the new ones"
        )
    if saved.step > run.total_steps:
        raise CheckpointError(f"checkpoint {path!r} is at step {saved.step}, past the {run.total_steps} optimizer steps of this "
                              "run: resume with the --max-steps or --epochs it was written with, or start a new --output-dir")
    check_scheduler_state(saved.scheduler, run.scheduler.state_dict(), saved.step, Path(path))
    check_loadable_without_code(Path(path))
    run._hooks.load_states(Path(path), saved.hooks, kept_in_state)
    fresh = [{key: value for key, value in group.items() if key != "params"} for group in run.optimizer.param_groups]
    try:
        with loading_without_code():
            accelerator.load_state(path, **trainable_only_load(accelerator, run.model, Path(path)))
    except (RuntimeError, KeyError, ValueError, IndexError, SafetensorError) as err:  # SafetensorError: not a safetensors file
        raise CheckpointError(f"checkpoint {path!r} does not fit this model or optimizer: {first_line(err)}") from None
    if relayout:
        saved = _continue_in_layout(run, saved, current)
    run._restore(saved)
    if changes:
        _apply_changes(run, fresh, changes)
        logger.info(f"--allow-config-change: applying {described}")
    logger.info(f"resumed from {path} at step {saved.step} (epoch {saved.epoch}, {saved.batch_in_epoch} batches into it)")
    if run._stream and current.data_fingerprint is None:
        logger.info("the training stream has no fingerprint attribute: whether it still holds the data the checkpoint was "
                    "trained on cannot be checked")
    return True


def _check_engine(accelerator, path: str) -> None:
    """A checkpoint loads under the engine that wrote it (Accelerate would look for files that are not there)."""
    wrote, now = checkpoint_engine(Path(path)), ENGINES.get(accelerator.distributed_type, "DDP")
    if wrote != now:
        weights = " (its weights alone: DeepSpeed's zero_to_fp32.py in that folder)" if wrote == "DeepSpeed" else ""
        shown = "DDP or single-process" if wrote == "DDP" else wrote
        raise CheckpointError(
            f"checkpoint {path!r} holds {shown} model and optimizer state and this run is {accelerator.distributed_type.value}: "
            f"resume it under {shown}, as it was written{weights}, or start a new --output-dir"
        )


def _check_relayout_supported(accelerator, saved: RunState, current: RunState, path: str) -> None:
    """DeepSpeed partitions optimizer state per process: its checkpoints load on their own count. (FSDP's DCP
    shards are resharded on load: they continue on another count.)"""
    if accelerator.distributed_type == DistributedType.DEEPSPEED and saved.num_processes != current.num_processes:
        raise CheckpointError(
            f"checkpoint {path!r} holds DeepSpeed ZeRO state partitioned over {saved.num_processes} processes and this run "
            f"has {current.num_processes}: resume on {saved.num_processes} processes (or convert it with DeepSpeed's "
            "ds_to_universal.py and load it with its universal-checkpoint support, outside acceltrain; a run trained under "
            "DDP or FSDP resumes on another process count)"
        )


def _continue_in_layout(run: Run, saved: RunState, current: RunState) -> RunState:
    """A checkpoint of another layout: the same samples of the epoch done, counted in this layout's batches.
    The data order and augmentation are keyed on (seed, epoch, index), so they continue unchanged; the
    per-process RNG streams (dropout) cannot map onto another count and are re-derived from (seed, step,
    process index)."""
    from accelerate.utils import set_seed

    from .data import mix_seed

    if saved.num_processes != current.num_processes:
        set_seed(mix_seed(run.cfg.seed, saved.step, run.accelerator.process_index) % 2**32)
    logger.info(f"resuming a checkpoint of {saved.layout()} on {current.layout()}; per-process random streams "
                f"{'re-derived' if saved.num_processes != current.num_processes else 'kept'}")
    moved = saved.in_layout(current)
    # Accelerate counts the epoch's micro-batches to know when a window closes, and restored the old layout's count
    # (or, for a process index the checkpoint did not have, none)
    run.accelerator.step = moved.batch_in_epoch
    return moved


def _apply_changes(run: Run, fresh_groups: list[dict], changes: dict) -> None:
    """After ``load_state`` put the checkpoint's optimizer hyperparameters back: the new settings' (lr,
    momentum, weight decay) replace them, and the schedule continues from the new peak at the same step."""
    run._state.config_changes.update(changes)
    for group, fresh in zip(run.optimizer.param_groups, fresh_groups):
        group.update(fresh)
    run.scheduler.base_lrs = [group["initial_lr"] for group in run.optimizer.param_groups]
    values = [base * multiplier(run.scheduler.last_epoch) for base, multiplier in zip(run.scheduler.base_lrs, run.scheduler.lr_lambdas)]
    for group, value in zip(run.optimizer.param_groups, values):
        group["lr"] = value
    run.scheduler._last_lr = values


def _divide_gradients(model: nn.Module, divisor: torch.Tensor) -> None:
    for param in model.parameters():
        if param.grad is not None:
            param.grad.div_(divisor.to(param.grad.dtype))
