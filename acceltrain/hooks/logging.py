"""What a run reports and where it goes: the training-log schedule (loss, lr, speed every N steps),
and the writers of every logged row (metrics.jsonl, Accelerate's trackers, the progress bar)."""

from __future__ import annotations

import time
from pathlib import Path

from accelerate.logging import get_logger

from acceltrain.config.groups import LoggingOptions
from acceltrain.hooks.base import Hook
from acceltrain.hooks.evaluation import Evaluation
from acceltrain.runtime.logs import show_progress
from acceltrain.runtime.metrics import EventLog, peak_memory_mb, synchronize
from acceltrain.runtime.peak import forget_peak
from acceltrain.runtime.run_folder import METRICS_FILE
from acceltrain.runtime.tracking import finish_tracking, start_tracking

logger = get_logger(__name__)


class TrainingLog(Hook):
    """Every ``every`` optimizer steps and at the last one: the mean training loss over all processes
    since the previous row, lr, grad norm, steady-state speed and peak memory. Also times the launch's
    first step (compilation) and puts the whole run's speed figures into the summary."""

    def __init__(self, every: int):
        self.every = every
        self.first_step_seconds: float | None = None
        self.peak_below = False  # the run went faster than the peak MFU divides by: no MFU from then on

    @classmethod
    def from_config(cls, cfg: LoggingOptions) -> TrainingLog:
        return cls(cfg.log_every)

    def on_step_end(self, run) -> None:
        if self.first_step_seconds is None:
            synchronize(run.accelerator.device)
            self.first_step_seconds = time.perf_counter() - run.launch_started
        if run.step % self.every and run.step != run.total_steps:
            return
        row = {
            "step": run.step,
            "epoch": run.epoch_progress,
            "loss": run.take_train_loss(),
            "lr": run.lr,
            "wall_seconds": round(run.elapsed(), 3),
            **self._honest(run, speed_figures(run, run.throughput.window(), _token_counts(run, window=True))),
            **peak_memory_mb(run.accelerator.device),
            **run.engine.figures(),
        }
        if run.grad_norm is not None:
            row["grad_norm"] = float(run.grad_norm)
        if run.skipped_steps or run.accelerator.mixed_precision == "fp16":
            row["skipped_steps"] = run.skipped_steps
        run.log(row)

    def on_fit_end(self, run, summary: dict) -> None:
        totals = run.throughput.totals()
        ms_per_step = totals["ms_per_step"]
        compile_seconds = None
        if run.cfg.compile and self.first_step_seconds is not None:  # the first step less a steady one
            compile_seconds = max(0.0, self.first_step_seconds - (ms_per_step or 0.0) / 1000)
        summary.update(
            self._honest(run, speed_figures(run, totals, _token_counts(run, window=False))),
            timed_steps=totals["timed_steps"],
            first_step_seconds=self.first_step_seconds,
            compile_seconds=compile_seconds,
        )

    def _honest(self, run, figures: dict) -> dict:
        """No MFU above 1. The peak it divides by is then below what the devices did: a calibration on a busy
        machine (which leaves the cache: the next run measures again), or a low ``--peak-tflops``. Said once."""
        if not self.peak_below and (figures.get("mfu") or 0) > 1:
            self.peak_below = True
            reached = figures["model_tflops_per_second"] / run.accelerator.num_processes
            if run.cfg.peak_tflops is None:
                if run.accelerator.is_main_process:
                    accelerator = run.accelerator
                    forget_peak(accelerator.device, accelerator.mixed_precision, tuple(run.runtime["peak_flops_shape"]))
                source = f"the measured peak of {run.peak_flops / 1e12:.3g} (calibrated too low: a busy machine)"
                remedy = "it leaves the cache: the next run measures again"
            else:
                source, remedy = f"--peak-tflops {run.cfg.peak_tflops:g}", "give the device's real peak in TFLOP/s"
            logger.warning(
                f"mfu: this run reached {reached:.3g} TFLOP/s per device, above {source}; mfu is not reported "
                f"({remedy})"
            )
        if self.peak_below and "mfu" in figures:
            figures["mfu"] = None
        return figures


def speed_figures(run, figures: dict, tokens: dict | None = None) -> dict:
    """samples/s, ms/step and data-wait fraction, plus tokens/s for tasks that count tokens, and model
    FLOP/s and MFU where the FLOPs are known: against the devices' measured peak (or ``--peak-tflops``), and against
    their datasheet peak where one is known. With the task's ``tokens`` counts (real, slots and rows of its batches:
    :class:`~acceltrain.text.lm.TokenTally`), real tokens/s (samples/s times the real tokens of a sample in those
    batches: padding left out, as packing changes it) and the share of real tokens in the batches' rows."""
    rate = figures["samples_per_second"]
    out = {key: value for key, value in figures.items() if key != "timed_steps"}
    tokens_per_sample = getattr(run.task, "tokens_per_sample", None)
    if tokens_per_sample:
        out["tokens_per_second"] = rate * tokens_per_sample if rate else None
    if tokens is not None and tokens["rows"]:
        out["real_tokens_per_second"] = rate * tokens["real"] / tokens["rows"] if rate else None
        out["real_token_share"] = tokens["real"] / tokens["slots"]
    if run.flops_per_sample and rate:
        flops = rate * run.flops_per_sample
        out["model_tflops_per_second"] = flops / 1e12
        devices = run.accelerator.num_processes
        out["mfu"] = flops / (run.peak_flops * devices) if run.peak_flops else None
        datasheet = run.runtime.get("peak_flops_datasheet")
        if datasheet:  # a GPU's: an upper bound no run reaches, beside the measured one
            out["mfu_datasheet"] = flops / (datasheet * devices)
    return out


def _token_counts(run, *, window: bool) -> dict | None:
    """The task's token counts since the previous log row (``window``) or of the whole launch; None for a task
    that does not count them."""
    tally = getattr(run.task, "token_tally", None)
    if tally is None:
        return None
    return tally.take_window() if window else tally.total


class MetricsFile(Hook):
    """Every logged row as one JSON line in ``metrics.jsonl`` (main process). A resumed run first drops
    the rows past its checkpoint's step, which it is about to replay: every step appears once."""

    def on_fit_start(self, run) -> None:
        path = run.output_dir / METRICS_FILE if run.accelerator.is_main_process else None
        self.events = EventLog(path, keep_until_step=run.step)

    def on_log(self, run, metrics: dict) -> None:
        self.events.write(metrics)

    def on_train_end(self, run) -> None:
        if run.stop is not None and not run.stop.finish:  # stopped to be resumed: no on_fit_end follows
            self.events.close()

    def on_fit_end(self, run, summary: dict) -> None:  # after the hooks before it, which may still log (an evaluation)
        self.events.close()

    def on_exception(self, run, error: Exception) -> None:
        self.events.close()


class Trackers(Hook):
    """Accelerate's trackers (W&B, TensorBoard): the run starts with the resolved config (continuing
    the same W&B run on resume), every row is logged at its step, and the summary equals summary.json.
    Always among the built-in hooks, with no trackers too: the W&B run id, its state, goes on through a
    launch without them."""

    def __init__(self, names: list[str], run_config: dict):
        self.names, self.run_config = names, run_config
        self.run_id: str | None = None

    def state_dict(self) -> dict:
        return {"run_id": self.run_id}

    def load_state_dict(self, state: dict) -> None:
        self.run_id = state["run_id"]

    def on_fit_start(self, run) -> None:
        self.run_id = (
            start_tracking(
                run.accelerator,
                run.cfg,
                self.names,
                run_name=run.cfg.run_name or run.output_dir.name,
                output_dir=run.output_dir,
                run_config=self.run_config,
                resume_run_id=self.run_id,
            )
            or self.run_id
        )

    def on_log(self, run, metrics: dict) -> None:
        if self.names:
            run.accelerator.log(
                {k: v for k, v in metrics.items() if k != "step" and v is not None}, step=metrics["step"]
            )

    def on_fit_end(self, run, summary: dict) -> None:
        finish_tracking(
            run.accelerator,
            self.names,
            summary,
            Path(summary["weights"]),
            run.cfg.log_model,
            extra_files=run.attached_files,
        )


class Console(Hook):
    """Logged rows as info lines on the main process (``--log-level warning`` hides them), above a tqdm bar
    over optimizer steps when ``progress`` (the log handler writes through ``tqdm.write``: the bar stays whole).

    The bar's rate and time left are the training steps' alone: the time of each evaluation is taken out
    of its clock, and the evaluations still to come are shown next to it at the duration of the last one
    (``+4 evals ~01:20``), so the two estimates add up to when the run ends."""

    def __init__(self, progress: bool | None, evaluation: Evaluation | None = None):
        self.progress = show_progress(progress)
        self.evaluation = evaluation  # the run's schedule, which knows the evaluations to come

    @classmethod
    def from_config(cls, cfg: LoggingOptions, evaluation: Evaluation | None) -> Console:
        return cls(cfg.progress, evaluation)

    def on_fit_start(self, run) -> None:
        from tqdm.auto import tqdm

        self.main = run.accelerator.is_main_process
        self.bar = tqdm(
            total=run.total_steps,
            initial=run.step,
            desc="train",
            dynamic_ncols=True,
            disable=not (self.main and self.progress),
        )

    def on_step_end(self, run) -> None:
        self.bar.update(1)

    def on_eval_end(self, run, metrics: dict) -> None:
        seconds = run.last_eval_seconds
        if (
            not self.bar.disable
        ):  # the evaluation's time out of the training clock (tqdm's unpause() would drop the step's too)
            self.bar.start_t += seconds
            self.bar.last_print_t += seconds
        left = self.evaluation.left(run) if self.evaluation else 0
        self.bar.set_postfix_str(
            f"+{left} eval{'s' if left != 1 else ''} ~{self.bar.format_interval(left * seconds)}" if left else ""
        )

    def on_log(self, run, metrics: dict) -> None:
        if self.main:
            logger.info(" ".join(f"{k}={_fmt(v)}" for k, v in metrics.items()))

    def on_train_end(self, run) -> None:
        self.bar.close()


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
