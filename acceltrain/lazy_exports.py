"""Public names imported on first use (PEP 562), so that importing a package (a recipe's ``--help``, the
config parser) does not import torch, Accelerate or Transformers: seconds on a small machine."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from importlib import import_module

REMOVED_IN = "0.3"  # a moved name stays importable from its old place, with a DeprecationWarning, until then


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


def moved(old: str, homes: dict[str, str]) -> Callable[[str], object]:
    """``__getattr__`` for a module whose names moved elsewhere: ``homes`` maps each moved name to the
    module that defines it now; reading one warns (naming the new import) and returns it, so that a recipe
    written against the old layout still runs for a release."""

    def __getattr__(name: str) -> object:
        if name not in homes:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        warnings.warn(
            f"{old}.{name} moved to {homes[name]}.{name}: import it from there ({old}.{name} goes in "
            f"acceltrain {REMOVED_IN})",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(import_module(homes[name]), name)

    return __getattr__


def moved_module(old: str, new: str) -> Callable[[str], object]:
    """``__getattr__`` for a module that moved as a whole to ``new``: importing the old one warns once
    (at the importer's line: importlib's frames are skipped) and every name is read from the new one."""
    warnings.warn(
        f"{old} moved to {new}: import from there ({old} goes in acceltrain {REMOVED_IN})",
        DeprecationWarning,
        stacklevel=3,
    )
    module = import_module(new)

    def __getattr__(name: str) -> object:
        return getattr(module, name)

    return __getattr__
