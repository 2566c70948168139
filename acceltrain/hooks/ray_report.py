"""Inside a Ray Train worker (``acceltrain ray``): metrics and each published checkpoint go to Ray."""

from __future__ import annotations

from pathlib import Path

from acceltrain.hooks.base import Hook


class RayReport(Hook):
    """Each published checkpoint and the final summary go to ``ray.train.report`` (every process reports,
    as Ray Train V2 requires; the main process attaches the checkpoint folder)."""

    in_worker = False  # set by ``acceltrain ray``'s worker: the built-in hooks then include this one

    def on_save(self, run, folder: Path) -> None:
        import ray.train

        checkpoint = ray.train.Checkpoint.from_directory(str(folder)) if run.accelerator.is_main_process else None
        ray.train.report({"step": run.step}, checkpoint=checkpoint)

    def on_fit_end(self, run, summary: dict) -> None:
        import ray.train

        ray.train.report({k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
