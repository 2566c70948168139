"""acceltrain: one training loop on Hugging Face Accelerate, from a laptop CPU to a multi-node cluster."""

__version__ = "0.1.0"

from .config import ConfigError, TrainConfig, option, parse_config, require  # noqa: E402
from .distributed import on_main_process_first  # noqa: E402
from .hooks import EMA, Hook  # noqa: E402
from .loop import fit  # noqa: E402
from .optim import build_optimizer  # noqa: E402
from .run import Run, RunSetup, Stop, evaluate, setup_run  # noqa: E402
from .tasks import ClassificationTask, Task  # noqa: E402
from .cli import run_recipe  # noqa: E402

__all__ = [
    "EMA",
    "ClassificationTask",
    "ConfigError",
    "Hook",
    "Run",
    "RunSetup",
    "Stop",
    "Task",
    "TrainConfig",
    "build_optimizer",
    "evaluate",
    "fit",
    "on_main_process_first",
    "option",
    "parse_config",
    "require",
    "run_recipe",
    "setup_run",
]
