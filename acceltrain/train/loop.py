"""The training loop: a short core, the same on a CPU, one GPU, N GPUs or nodes. Everything optional (logging,
evaluation, checkpoints, preemption, profiling, trackers, your own) is a hook that the core calls at fixed points
(:mod:`acceltrain.hooks`); the prepare step is :mod:`acceltrain.train.prepare`, where training stands is
:class:`~acceltrain.train.state.TrainState`, and checkpoints are the :class:`~acceltrain.checkpoint.Checkpointer`'s.

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
from pathlib import Path

import yaml
from accelerate.logging import get_logger
from torch import nn
from torch.utils.data import Dataset

from acceltrain.checkpoint import Checkpointer
from acceltrain.config.options import ConfigError, parse_json
from acceltrain.config.train_config import TrainConfig
from acceltrain.data.loaders import stop_workers
from acceltrain.data.streams import check_stream, is_stream
from acceltrain.hooks import Hooks, builtin_hooks
from acceltrain.hooks.checkpoint import checkpoint_plan, saves_checkpoints
from acceltrain.runtime.logs import set_log_level, start_block
from acceltrain.runtime.metrics import peak_memory_mb
from acceltrain.runtime.preemption import StoppedToResume
from acceltrain.runtime.run_folder import (
    SUMMARY_FILE,
    claim_run_folder,
    write_summary,
)
from acceltrain.runtime.tracking import active_trackers
from acceltrain.train.export import export_weights
from acceltrain.train.prepare import Prepared, prepare
from acceltrain.train.run import Run
from acceltrain.train.state import TrainState
from acceltrain.train.tasks import ClassificationTask, check_task

logger = get_logger(__name__)


@dataclasses.dataclass
class _Loop:
    """What the core loop drives: the hooks' view, the hooks, the training state, and the checkpoints."""

    run: Run
    hooks: Hooks
    state: TrainState
    checkpointer: Checkpointer


def fit(
    cfg: TrainConfig,
    model: nn.Module,
    optimizer,
    train_set: Dataset,
    eval_set: Dataset | None = None,
    *,
    task=None,
    hooks=(),
    name: str = "run",
    collate_fn=None,
) -> dict:
    """Train ``model`` on ``train_set`` as ``cfg`` says; returns the summary also written to
    ``<output_dir>/summary.json``. ``task`` turns batches into losses and eval values (default:
    :class:`ClassificationTask`; see :class:`acceltrain.Task`); ``hooks`` are your own
    :class:`acceltrain.Hook` objects, run before the built-in ones; ``name`` names the default output folder;
    ``collate_fn`` makes each batch of samples, training and eval (default: torch's ``default_collate``; padding
    per batch: ``transformers.DataCollatorWithPadding(tokenizer)``)."""
    set_log_level(cfg.log_level)  # run_recipe did; code that calls fit() directly has not
    cfg.validate()  # likewise: a config built in code has not been checked
    task = ClassificationTask() if task is None else task
    check_task(task, evaluates=eval_set is not None)
    if is_stream(train_set):
        check_stream(cfg, train_set, eval_set)
    trackers = active_trackers(cfg)
    folder = claim_run_folder(cfg, name, task)
    with folder.left_as_found():
        prepared = prepare(cfg, folder.output_dir, model, optimizer, train_set, eval_set, task, collate_fn, trackers)
        loop = _assemble(prepared, task, hooks, trackers)
        try:
            if prepared.cfg.resume and not loop.checkpointer.restore():
                return _already_finished(loop.run)
            loop.hooks.call("on_fit_start", loop.run)
            try:
                loop.checkpointer.check_states()
                folder.trained = True  # from here on a failure keeps the run folder as it is
                _train(loop)
                return _finish(loop)
            except Exception as error:  # not SystemExit: a stop to be resumed keeps its handlers to the end
                loop.hooks.call("on_exception", loop.run, error)
                raise
        finally:
            loop.checkpointer.release()
            stop_workers(prepared.train_batches, prepared.eval_batches)


def _assemble(prepared: Prepared, task, user_hooks, trackers: list[str]) -> _Loop:
    """The run's pieces around the prepared ones: the training state, the hooks, the hooks' view, the checkpointer;
    then the start-up log."""
    cfg = prepared.cfg
    state = TrainState(prepared)
    hooks = Hooks(
        user_hooks,
        builtin_hooks(
            cfg,
            evaluates=prepared.eval_batches is not None,
            trackers=trackers,
            run_config={**cfg.to_dict(), "runtime": prepared.runtime},
        ),
    )
    run = Run(prepared, task, state, hooks)
    checkpointer = Checkpointer(
        prepared, state, hooks.stateful, announce=lambda folder: hooks.call("on_save", run, folder)
    )
    logger.debug(yaml.safe_dump({"config": cfg.to_dict(), "runtime": prepared.runtime}, sort_keys=False).rstrip())
    checkpoints = checkpoint_plan(cfg)
    if saves_checkpoints(cfg) and checkpointer.note:  # an adapter run's checkpoints: said only where there are any
        checkpoints += f"; {checkpointer.note}"
    for line in [*start_block(prepared.runtime, cfg, checkpoints), *filter(None, prepared.notes)]:
        logger.info(line)
    return _Loop(run, hooks, state, checkpointer)


def _train(loop: _Loop) -> None:
    """The hot path: micro-batches, accumulation and the optimizer step; after each optimizer step the hooks,
    then one agreement on whether to save or stop."""
    run, hooks, state = loop.run, loop.hooks, loop.state
    accelerator, model = run.accelerator, run.model
    run.engine.join(state.step)  # a group that heals from a live peer (torchft) does so here, as a resume would
    state.start_clock()
    while state.step < state.total_steps:
        hooks.call("on_epoch_start", run)
        model.train()
        for batch in state.epoch_batches():
            opens, window = state.window()
            if opens:
                run.engine.start_step(state.step)
                hooks.call("on_step_start", run)
            with accelerator.accumulate(model):
                state.add_loss(*_backward(loop, batch, window))
                if accelerator.sync_gradients:
                    _optimizer_step(loop)
            if not accelerator.sync_gradients:
                continue
            state.step_done(window)
            hooks.call("on_step_end", run)
            if state.epoch_ended():
                hooks.call("on_epoch_end", run)
            loop.checkpointer.poll()
            save, stop = state.agree()
            if state.step == state.total_steps:
                return  # a stop asked for on the last step simply finishes the run
            if save or (stop and not stop.finish):
                _save(loop)
            if stop:
                state.end_early(stop)
                return
        if state.stream:
            _end_stream_pass(loop)


def _backward(loop: _Loop, batch, window: int):
    """The micro-batch's loss and its weight in the logged mean, backpropagated: a mean loss scaled by
    ``grad_accum / window`` (see the module docstring); a ``(loss sum, target count)`` summed, its count kept by
    the state for :func:`_optimizer_step` to normalise by."""
    run = loop.run
    loss = run.task.train_loss(run.model, batch)
    if not isinstance(loss, tuple):
        run.accelerator.backward(loss * (run.cfg.grad_accum / window))
        return loss, 1.0
    run.engine.refuse_setting("summed_losses")  # a task that did not say sums_losses
    loss, count = loss
    run.accelerator.backward(loss)
    return loss, count


def _optimizer_step(loop: _Loop) -> None:
    """The end of a window: normalise summed losses' gradients by the window's target count on all
    processes, unscale and clip, ``on_before_optimizer_step``, then step (a grad-scaler skip leaves the
    schedule where it is)."""
    run, state = loop.run, loop.state
    accelerator = run.accelerator
    targets = state.take_window_targets()
    if targets is not None:
        targets = accelerator.reduce(targets, "sum")
        divisor = targets / (run.cfg.grad_accum * accelerator.num_processes)
        for param in run.model.parameters():
            if param.grad is not None:
                param.grad.div_(divisor.to(param.grad.dtype))
    run.engine.average_gradients(run.model)
    grad_norm = None
    if run.cfg.max_grad_norm is None:  # the true gradients for on_before_optimizer_step: unscaled under fp16, clipped
        accelerator.unscale_gradients()  # a no-op but under fp16
    else:
        grad_norm = accelerator.clip_grad_norm_(run.model.parameters(), run.cfg.max_grad_norm)
    state.optimizer_stepping(run.scheduler.get_last_lr()[0], grad_norm)
    loop.hooks.call("on_before_optimizer_step", run)
    if state.optimizer_stepped(run.engine.step_optimizer(run.optimizer)):
        run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)


def _end_stream_pass(loop: _Loop) -> None:
    """A stream's pass ends where the stream does, maybe inside a window (else ``on_epoch_end`` has fired)."""
    run, state = loop.run, loop.state
    if not state.run_state.batch_in_epoch:
        raise ConfigError(
            f"the training stream yielded no batch of {run.cfg.batch_size} per process in pass "
            f"{state.run_state.epoch}: it holds fewer samples than one batch on each of "
            f"{run.accelerator.num_processes} processes"
        )
    if not run.accelerator.sync_gradients:
        loop.hooks.call("on_epoch_end", run)
    state.next_pass()


def _save(loop: _Loop) -> None:
    """Checkpoint now, outside the throughput figures; while training, a row of the log says how long it blocked
    (the saves at the end are in summary.json's total)."""
    run, state = loop.run, loop.state
    with state.paused():
        blocked = loop.checkpointer.save()
    state.checkpointed(loop.checkpointer.last_saved_step)
    if state.training:
        run.log({"step": run.step, "checkpoint_seconds": round(blocked, 4), "wall_seconds": round(run.elapsed(), 3)})


def _finish(loop: _Loop) -> dict:
    """A stop to be resumed exits 75 (checkpointed in the loop); a finished run writes its outputs."""
    run, state, checkpointer = loop.run, loop.state, loop.checkpointer
    accelerator = run.accelerator
    state.throughput.pause()
    wall_seconds = run.elapsed()
    checkpointer.wait()  # a save in flight is published (its copy taken) before the hooks change any weight
    loop.hooks.call("on_train_end", run)
    if run.stop is not None and not run.stop.finish:
        logger.info(f"stopped at step {run.step} ({run.stop.reason}); checkpoint saved; continue with --resume auto")
        accelerator.wait_for_everyone()
        accelerator.end_training()
        raise StoppedToResume(run.stop.exit_code, run.step, run.stop.reason)
    save, _ = state.agree()
    if save and checkpointer.last_saved_step != run.step:
        _save(loop)
    checkpointer.close()
    run.engine.training_ended(run.model, run.step)
    export = state.export
    if isinstance(export, Path):  # a checkpoint's model: loaded into the model, then written as its own
        checkpointer.load_model_of(export)
        export = None
    weights = export_weights(accelerator, run.model, run.output_dir, export)
    summary = _summary(loop, weights, wall_seconds)
    loop.hooks.call("on_fit_end", run, summary)
    if accelerator.is_main_process:
        write_summary(run.output_dir, summary)
        metric = f"eval_{getattr(run.task, 'primary_metric', 'loss')}"
        stopped = f" (stopped: {summary['stop_reason']})" if summary["stop_reason"] else ""
        logger.info(
            f"done: {run.step} steps{stopped}, train loss {_rounded(summary['train_loss'])}, {metric} "
            f"{_rounded(summary.get(metric))}, outputs in {run.output_dir}"
        )
    accelerator.wait_for_everyone()
    accelerator.end_training()  # trackers, then the process group
    return summary


def _rounded(value) -> str:
    """A figure of the done line at 4 significant digits, as the progress lines show them (summary.json keeps all)."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _summary(loop: _Loop, weights: Path, wall_seconds: float) -> dict:
    """The run's record; hooks add their own entries (speed figures, time to target) in ``on_fit_end``."""
    run, state = loop.run, loop.state
    eval_metrics = run.last_eval
    epochs = (
        run.epoch_progress
        if state.stream
        else round(run.samples_seen / (run.batches_per_epoch * state.global_batch_size), 4)
    )
    return {
        "steps": run.step,
        "stop_reason": run.stop.reason if run.stop is not None else None,  # None: it ran to its last step
        "samples_seen": run.samples_seen,
        "epochs": epochs,
        "train_loss": state.final_train_loss(),
        "eval_accuracy": eval_metrics.get("eval_accuracy"),
        "eval_loss": eval_metrics.get("eval_loss"),
        **eval_metrics,  # a task's own metrics too (eval_perplexity)
        "skipped_steps": run.skipped_steps,
        "checkpoint_seconds": round(loop.checkpointer.seconds_blocked, 4),  # this launch's time blocked by saves
        "checkpoint_wait_seconds": round(loop.checkpointer.seconds_waited, 4),  # of which: steps waiting for a copy
        "wall_seconds": wall_seconds,
        "resumed_from_step": loop.checkpointer.resumed_from_step,
        "num_processes": run.accelerator.num_processes,
        "distributed_type": run.accelerator.distributed_type.value,
        "mixed_precision": run.accelerator.mixed_precision,
        "final_lr": run.scheduler.get_last_lr()[0],
        **peak_memory_mb(run.accelerator.device),
        "weights": str(weights),
        **({"config_changes": state.run_state.config_changes} if state.run_state.config_changes else {}),
        "runtime": run.runtime,
        "config": run.cfg.to_dict(),
    }


def _already_finished(run: Run) -> dict:
    """``--resume`` of a run that has finished at its newest checkpoint: nothing to train, nothing rewritten."""
    summary = parse_json((run.output_dir / SUMMARY_FILE).read_text())
    logger.info(f"the run in {run.output_dir} already finished at step {summary['steps']}; nothing to do")
    run.accelerator.end_training()
    return summary
