"""What preparing the text did to it (examples truncated or dropped at the length limit, the padding left in
the batches), said when training starts and kept in summary.json."""

from __future__ import annotations

from accelerate.logging import get_logger

from acceltrain.hooks.base import Hook

logger = get_logger(__name__)


class DataReport(Hook):
    """``entries``: summary entries (``{"truncated_examples": {"train": 3, "eval": 0}, ...}``)."""

    def __init__(self, entries: dict):
        self.entries = entries

    def on_fit_start(self, run) -> None:
        logger.info(
            "data: "
            + "; ".join(
                f"{key.replace('_', ' ')} {_shown(value, key.endswith('_fraction'))}"
                for key, value in self.entries.items()
            )
        )

    def on_fit_end(self, run, summary: dict) -> None:
        summary.update(self.entries)


def _shown(value, fraction: bool) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{_shown(item, fraction)} {key}" for key, item in value.items())
    if isinstance(value, float):
        return f"{value:.1%}" if fraction else f"{value:.4g}"
    return str(value)
