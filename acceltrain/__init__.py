"""acceltrain: one training loop on Hugging Face Accelerate, from a laptop CPU to a multi-node cluster."""

__version__ = "0.1.0"

from .config import ConfigError, TrainConfig, option, parse_config, require  # noqa: E402
from .loop import evaluate, fit  # noqa: E402
from .optim import build_optimizer  # noqa: E402
from .tasks import ClassificationTask  # noqa: E402
from .cli import run_recipe  # noqa: E402

__all__ = [
    "ClassificationTask",
    "ConfigError",
    "TrainConfig",
    "build_optimizer",
    "evaluate",
    "fit",
    "option",
    "parse_config",
    "require",
    "run_recipe",
]
