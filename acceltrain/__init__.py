"""acceltrain: one training loop on Hugging Face Accelerate, from a laptop CPU to a multi-node cluster.

The public names are imported on first use (PEP 562), so that ``--help``, ``acceltrain --version`` and
the config parser answer without importing torch and Accelerate (seconds on a small machine).
"""

from importlib.metadata import PackageNotFoundError, version

from acceltrain.lazy_exports import lazy_exports
from acceltrain.runtime.logs import install_console_handler


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
install_console_handler()  # the toolkit's lines at info by default, as transformers' do (acceltrain.runtime.logs)

_HOME = {  # public name -> the submodule that defines it
    "ConfigError": "config.options",
    "TrainConfig": "config.train_config",
    "option": "config.options",
    "parse_config": "config.parser",
    "require": "config.options",
    "Options": "config.options",
    "on_main_process_first": "runtime.distributed",
    "EMA": "hooks",
    "Hook": "hooks",
    "Lookahead": "hooks",
    "fit": "train.loop",
    "load_model": "hf.hub",
    "LoraOptions": "hf.lora",
    "apply_lora": "hf.lora",
    "show_progress": "runtime.logs",
    "build_optimizer": "train.optim",
    "predict": "commands.predict",
    "Run": "train.run",
    "Stop": "train.run",
    "evaluate": "train.run",
    "RunFolder": "runtime.run_folder",
    "claim_run_folder": "runtime.run_folder",
    "ClassificationTask": "train.tasks",
    "Task": "train.tasks",
    "run_recipe": "commands.cli",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _HOME)
