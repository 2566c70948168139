"""Checkpoints: the one owner of saving and restoring a run (:class:`Checkpointer`), and what it is made of.

- :mod:`.manager`: :class:`Checkpointer`, what the loop calls (restore, save, poll, wait, close);
- the model and optimizer parts come from the run's engine (:mod:`acceltrain.engines`), one builder for both writers;
- :mod:`.writers`: the synchronous and the asynchronous writer (one protocol);
- :mod:`.state`: the :class:`RunState` schema (``trainer_state.json``) and its validation;
- :mod:`.files`: staging, publishing, verifying, finding and rotating checkpoint folders;
- :mod:`.safe_load`: loading without running code (pickle and DCP guards);
- :mod:`.adapters`: an adapter run's checkpoints of its trainable weights.

Names are imported on first use, as the package's own (:mod:`acceltrain.lazy_exports`).
"""

from acceltrain.lazy_exports import lazy_exports

_HOME = {
    "Checkpointer": "manager",
    "CheckpointError": "state",
    "RunState": "state",
    "COMPLETE_FILE": "files",
    "STATE_FILE": "state",
    "checkpoint_dir": "files",
    "checkpoint_engine": "files",
    "complete_checkpoints": "files",
    "find_resume_checkpoint": "files",
    "rotate_checkpoints": "files",
    "verify_checkpoint": "files",
    "check_loadable_without_code": "safe_load",
    "loading_without_code": "safe_load",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _HOME)
