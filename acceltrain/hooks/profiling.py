"""Looking inside a run: ``--profile-steps A:B`` (torch.profiler over those optimizer steps) and
``--memory-report`` (memory after model build, first forward, first backward, first optimizer step)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from accelerate.logging import get_logger

from acceltrain.config.groups import ProfilingOptions, parse_step_range
from acceltrain.config.options import ConfigError
from acceltrain.hooks.base import Hook
from acceltrain.runtime.run_folder import MEMORY_FILE

logger = get_logger(__name__)


class Profiler(Hook):
    """Runs ``torch.profiler`` on the main process from the start of optimizer step A to the end of step B
    (CPU and CUDA activities, shapes and memory recorded), then writes ``profile/trace.json`` (open it in
    Perfetto or chrome://tracing) and ``profile/top_ops.txt`` (top operators by time and by memory),
    both attached to the tracker run. A run that ends inside the range (it has fewer steps, it stops to
    be resumed, it crashes) writes the steps that ran: a profiler still running at interpreter exit
    segfaults, and its trace is lost."""

    def __init__(self, steps: str, with_stack: bool):
        self.steps = steps
        self.range = parse_step_range(steps)
        self.with_stack = with_stack
        self._profiler = None

    @classmethod
    def from_config(cls, cfg: ProfilingOptions) -> Profiler | None:
        return cls(cfg.profile_steps, cfg.profile_with_stack) if cfg.profile_steps else None

    def on_fit_start(self, run) -> None:
        if self.range[0] > run.total_steps:
            raise ConfigError(
                f"--profile-steps {self.steps!r} starts after the run's last step ({run.total_steps}): "
                f"nothing would be profiled; give A:B with A <= {run.total_steps}"
            )
        self.folder = run.output_dir / "profile"
        self.enabled = run.accelerator.is_main_process  # the others train
        self._step_ended(run, run.step)

    def on_step_end(self, run) -> None:
        self._step_ended(run, run.step)

    def on_train_end(self, run) -> None:
        self._stop(run)

    def on_exception(self, run, error: Exception) -> None:
        self._stop(run)

    def _step_ended(self, run, step: int) -> None:
        if not self.enabled:
            return
        first, last = self.range
        if step == first - 1:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self._profiler = profile(
                activities=activities, record_shapes=True, profile_memory=True, with_stack=self.with_stack
            )
            self._profiler.__enter__()
        elif step == last:
            self._stop(run)

    def _stop(self, run) -> None:
        """Stop a running profiler and write what it recorded, up to the step the run has reached."""
        if self._profiler is None:
            return
        self._profiler.__exit__(None, None, None)
        for path in self._write(run.step):
            run.attach(path)
        self._profiler = None

    def _write(self, last_step: int) -> list[Path]:
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / "trace.json"
        self._profiler.export_chrome_trace(str(trace))
        averages = self._profiler.key_averages()
        time_key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        memory_key = "self_cuda_memory_usage" if torch.cuda.is_available() else "self_cpu_memory_usage"
        first, last = self.range
        cut = "" if last_step == last else f" (asked for {first}..{last}: the run ended at step {last_step})"
        table = (
            f"optimizer steps {first}..{last_step}{cut}\n\n== top operators by time ({time_key})\n"
            + averages.table(sort_by=time_key, row_limit=25)
            + f"\n\n== top operators by memory ({memory_key})\n"
            + averages.table(sort_by=memory_key, row_limit=25)
        )
        top = self.folder / "top_ops.txt"
        top.write_text(table)
        return [trace, top]


class MemoryReport(Hook):
    """Memory at the points that separate weights, activations, gradients and optimizer state: after the
    model is on its device, after the first forward, after the first backward (just before the first
    optimizer step), after the first optimizer step; printed and written to ``memory.json`` by the main
    process. CUDA: allocated / reserved / max allocated; CPU: the process's resident set. The points
    are one-shot forward and optimizer-step hooks, so the loop's hot path carries nothing for them."""

    @classmethod
    def from_config(cls, cfg: ProfilingOptions) -> MemoryReport | None:
        return cls() if cfg.memory_report else None

    def on_fit_start(self, run) -> None:
        self.device = run.accelerator.device
        self.rows: list[dict] = []
        self._mark("model on device")
        optimizer = getattr(
            run.optimizer, "optimizer", run.optimizer
        )  # the torch optimizer inside Accelerate's wrapper
        module = run.accelerator.unwrap_model(run.model)
        self._handles = [
            module.register_forward_hook(lambda *_: self._mark("first forward")),
            optimizer.register_step_pre_hook(lambda *_: self._mark("first backward")),
            optimizer.register_step_post_hook(lambda *_: self._mark("first optimizer step")),
        ]

    def on_step_end(self, run) -> None:
        if self._handles:
            for handle in self._handles:
                handle.remove()
            self._handles = []
            if run.accelerator.is_main_process:
                self._write(run.output_dir)

    def _mark(self, stage: str) -> None:
        if any(row["stage"] == stage for row in self.rows):
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            row = {
                "allocated_mb": torch.cuda.memory_allocated(self.device) / 2**20,
                "reserved_mb": torch.cuda.memory_reserved(self.device) / 2**20,
                "max_allocated_mb": torch.cuda.max_memory_allocated(self.device) / 2**20,
            }
        else:
            row = {"rss_mb": _current_rss_mb()}
        self.rows.append({"stage": stage, **row})

    def _write(self, output_dir: Path) -> None:
        (output_dir / MEMORY_FILE).write_text(json.dumps(self.rows, indent=2))
        columns = [key for key in self.rows[0] if key != "stage"]
        lines = [f"{'memory':<24}" + "".join(f"{c:>18}" for c in columns)]
        previous = None
        for row in self.rows:
            delta = f"  (+{row[columns[0]] - previous:.1f})" if previous is not None else ""
            lines.append(f"{row['stage']:<24}" + "".join(f"{row[c]:>18.1f}" for c in columns) + delta)
            previous = row[columns[0]]
        logger.info("\n".join(lines))


def _current_rss_mb() -> float:
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
        import os

        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:  # not Linux: fall back to the peak, which is what the platform offers
        from acceltrain.runtime.metrics import peak_memory_mb

        return next(iter(peak_memory_mb(torch.device("cpu")).values()))
