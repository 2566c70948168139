"""Moved to :mod:`acceltrain.engines` in 0.4; importable here, with a DeprecationWarning, until ``REMOVED_IN``."""

from .lazy_exports import moved_module

__getattr__ = moved_module(__name__, "acceltrain.engines")
