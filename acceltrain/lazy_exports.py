"""Public names imported on first use (PEP 562), so that importing a package (a recipe's ``--help``, the
config parser) does not import torch, Accelerate or Transformers: seconds on a small machine."""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib import import_module


def lazy_exports(
    package: str, homes: dict[str, str]
) -> tuple[Callable[[str], object], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for ``package``'s ``__init__``; ``homes`` maps each public name
    to the submodule that defines it, imported when the name is first read."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> object:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(f".{homes[name]}", package), name)
        namespace[name] = value  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *homes})

    return __getattr__, __dir__, sorted(homes)
