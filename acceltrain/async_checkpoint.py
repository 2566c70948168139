"""Moved in 0.4: ``--async-checkpoint`` is one of the two writers of :mod:`acceltrain.checkpoint.writers`; the
names stay importable here, with a DeprecationWarning, until ``REMOVED_IN``."""

from .lazy_exports import moved

__getattr__ = moved(
    __name__,
    {"check_async_supported": "acceltrain.checkpoint.manager", "AsyncCheckpointer": "acceltrain.checkpoint.writers"},
)
