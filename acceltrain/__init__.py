"""acceltrain: one training loop on Hugging Face Accelerate, from a laptop CPU to a multi-node cluster.

The public names are imported on first use (PEP 562), so that ``--help``, ``acceltrain --version`` and
the config parser answer without importing torch and Accelerate (seconds on a small machine).
"""

from importlib.metadata import PackageNotFoundError, version

from .lazy_exports import lazy_exports
from .logs import install_console_handler


def _checkout_version() -> str:
    """pyproject.toml's version, read from the checkout when it runs from ``PYTHONPATH`` uninstalled."""
    import re
    from pathlib import Path

    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    found = re.search(r'^version = "([^"]+)"', pyproject.read_text(), re.M) if pyproject.is_file() else None
    return f"{found[1]}+checkout" if found else "unknown"


try:
    __version__ = version("acceltrain")  # the one version, pyproject.toml's
except PackageNotFoundError:
    __version__ = _checkout_version()
install_console_handler()  # the toolkit's lines show at info by default, as transformers' do (see acceltrain.logs)

_HOME = {  # public name -> the submodule that defines it
    "ConfigError": "config",
    "TrainConfig": "config",
    "option": "config",
    "parse_config": "config",
    "require": "config",
    "Options": "options",
    "on_main_process_first": "distributed",
    "EMA": "hooks",
    "Hook": "hooks",
    "Lookahead": "hooks",
    "fit": "loop",
    "load_model": "hub",
    "LoraOptions": "lora",
    "apply_lora": "lora",
    "show_progress": "logs",
    "build_optimizer": "optim",
    "predict": "predict",
    "Run": "run",
    "Stop": "run",
    "evaluate": "run",
    "RunFolder": "run_folder",
    "claim_run_folder": "run_folder",
    "ClassificationTask": "tasks",
    "Task": "tasks",
    "run_recipe": "cli",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _HOME)
