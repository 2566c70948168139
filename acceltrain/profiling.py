"""Moved to :mod:`acceltrain.hooks.profiling` in 0.1.0; importable here, with a DeprecationWarning, until 0.3
(``REMOVED_IN``)."""

from .lazy_exports import moved_module

__getattr__ = moved_module(__name__, "acceltrain.hooks.profiling")
