"""A recipe named on a command line (``acceltrain bench --recipe``, ``acceltrain ray RECIPE``): a script or a module,
imported in this process to read its config class, so that its flags are checked before anything starts."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import signal
import sys

DEFAULT_RECIPE = "acceltrain.recipes.resnet_cifar"  # installed with the package: bench needs no checkout


def is_script(recipe: str) -> bool:
    """``--recipe``: a file path (``recipes/resnet_cifar.py``) rather than a module name."""
    return recipe.endswith(".py") or os.sep in recipe


def module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def command(recipe: str, args: list[str], launch_config: str | None = None) -> list[str]:
    """A recipe's command line in a child process: ``python RECIPE ARGS`` (or ``-m MODULE``), or under ``accelerate
    launch --config_file``."""
    target = [recipe] if is_script(recipe) else ["-m", recipe]
    if launch_config is None:
        return [sys.executable, *target, *args]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", launch_config, *target, *args]


def die_with_parent() -> None:
    """In a child, before the recipe: SIGTERM when the command that started it dies (a SIGKILL, an OOM kill), so
    that no orphaned run keeps training and holding its folder (Linux; elsewhere nothing)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


RECIPE_MODULE = "acceltrain_bench_recipe"  # a --recipe script imported to read its config class, not run


def recipe_config_class(recipe: str, what: str = "--recipe") -> type:
    """The config class of ``--recipe``, to check the rows' command line before any row runs (and ``acceltrain ray``'s
    recipe, named ``what`` in messages, before Ray starts): the class its ``main(cfg)`` is annotated with, else the
    one TrainConfig subclass the recipe defines or imports. A script is imported under another name than
    ``__main__``, so its ``cli()`` does not run."""
    import inspect

    from acceltrain.config.options import ConfigError
    from acceltrain.config.train_config import TrainConfig

    module = _import_recipe(recipe, what)
    main = getattr(module, "main", None)
    if not callable(main):
        raise ConfigError(
            f"{what} {recipe!r} has no main(cfg): a recipe is a config class (a TrainConfig subclass), "
            f"main(cfg) and cli(), as {DEFAULT_RECIPE}"
        )
    parameters = list(inspect.signature(main).parameters.values())
    annotated = parameters[0].annotation if parameters else None
    if isinstance(annotated, type) and issubclass(annotated, TrainConfig):
        return annotated
    found = {
        value
        for value in vars(module).values()
        if isinstance(value, type) and issubclass(value, TrainConfig) and value is not TrainConfig
    }
    if len(found) == 1:
        return found.pop()
    raise ConfigError(
        f"{what} {recipe!r} has no config class: annotate main(cfg: YourConfig) with a TrainConfig subclass"
    )


def _import_recipe(recipe: str, what: str):
    """The recipe module, imported in this process; a file that is not Python, or that fails to import, is a
    ConfigError (``--recipe /etc/passwd``)."""
    from importlib.machinery import SourceFileLoader

    from acceltrain.config.options import ConfigError, first_line

    try:
        if not is_script(recipe):
            return importlib.import_module(recipe)
        loader = SourceFileLoader(RECIPE_MODULE, recipe)  # any file name: a script need not end in .py
        module = importlib.util.module_from_spec(importlib.util.spec_from_loader(RECIPE_MODULE, loader))
        sys.modules[RECIPE_MODULE] = module  # as importlib's recipe for a source file: dataclasses look it up
        loader.exec_module(module)
        return module
    except Exception as err:  # noqa: BLE001 - SyntaxError, ImportError, or whatever the recipe's own code raises
        raise ConfigError(f"{what} {recipe!r} cannot be loaded as a Python recipe: {first_line(err)}") from None


def unrecognized_arguments(
    tokens: list[str], parser: argparse.ArgumentParser, more_flags: list[str], hint: str
) -> Exception:
    """The one line for the tokens no parser took (``acceltrain bench`` and ``acceltrain ray``): each flag with the
    closest one ``parser`` or ``more_flags`` knows (a typo's likely meaning), then ``hint``: where flags are listed."""
    from acceltrain.config.options import ConfigError
    from acceltrain.config.parser import with_suggestion

    flags = [flag for action in parser._actions for flag in action.option_strings] + more_flags
    return ConfigError(
        "unrecognized arguments: " + " ".join(with_suggestion(token, flags) for token in tokens) + f" ({hint})"
    )
