"""Experiment tracking through Accelerate's trackers (``log_with``, ``init_trackers``, ``log``)."""

from __future__ import annotations

import importlib.util

from .config import ConfigError, TrainConfig

TRACKER_PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboard"}


def tracker_names(report_to: str) -> list[str]:
    if report_to == "none":
        return []
    if report_to == "all":
        return list(TRACKER_PACKAGES)
    return [report_to]


def check_trackers_installed(report_to: str) -> None:
    for name in tracker_names(report_to):
        package = TRACKER_PACKAGES[name]
        if importlib.util.find_spec(package) is None:
            raise ConfigError(f"--report-to {report_to} needs the {package!r} package: pip install {package}")


def start_tracking(accelerator, cfg: TrainConfig, run_name: str, run_config: dict) -> None:
    """One tracker run, created by the main process only (Accelerate's ``on_main_process``)."""
    if not tracker_names(cfg.report_to):
        return
    accelerator.init_trackers(
        cfg.project_name,
        config=_flat_scalars(run_config),
        init_kwargs={"wandb": {"name": run_name}},
    )


def _flat_scalars(config: dict, prefix: str = "") -> dict:
    """Trackers (TensorBoard's hparams in particular) take scalars only: flatten and stringify the rest."""
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flat_scalars(value, prefix=f"{name}."))
        elif value is None or isinstance(value, (bool, int, float, str)):
            flat[name] = value if value is not None else "None"
        else:
            flat[name] = str(value)
    return flat
