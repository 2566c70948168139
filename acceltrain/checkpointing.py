"""Split in 0.4 into :mod:`acceltrain.checkpoint` (checkpoints), :mod:`acceltrain.run_folder` (the run folder) and
:mod:`acceltrain.preemption` (signals and exit codes); each name stays importable here, with a DeprecationWarning
naming its new home, until ``REMOVED_IN``."""

from .lazy_exports import moved

_FOLDER = (
    "CHECKPOINTS_DIR",
    "LOCK_FILE",
    "METRICS_FILE",
    "SUMMARY_FILE",
    "WEIGHTS_FILE",
    "finished_steps",
    "lock_output_dir",
    "move_previous_run_aside",
    "resolve_output_dir",
    "unlock_output_dir",
    "write_summary",
)
_STOPS = (
    "EXIT_DIVERGED",
    "EXIT_INTERRUPTED",
    "EXIT_PREEMPTED",
    "PreemptionSignals",
    "StoppedToResume",
    "TrainingDiverged",
    "ignore_stop_signals",
)
_STATE = (
    "STATE_FILE",
    "CheckpointError",
    "MOVED_TO_HOOKS",
    "RENAMED_FIELDS",
    "REQUIRED_CONFIG",
    "REQUIRED_FIELDS",
    "RunState",
    "check_scheduler_state",
)
_FILES = (
    "COMPLETE_FILE",
    "checkpoint_dir",
    "checkpoint_engine",
    "complete_checkpoints",
    "failed_save",
    "failed_save_refused",
    "find_resume_checkpoint",
    "publish",
    "rotate_checkpoints",
    "staging_folder",
    "verify_checkpoint",
)
_SAFE = (
    "DCP_METADATA",
    "PICKLED_SUFFIXES",
    "allowed_enums",
    "check_loadable_without_code",
    "enum_member_getter",
    "loading_without_code",
)

__getattr__ = moved(
    __name__,
    {
        **dict.fromkeys(_FOLDER, "acceltrain.run_folder"),
        **dict.fromkeys(_STOPS, "acceltrain.preemption"),
        **dict.fromkeys(_STATE, "acceltrain.checkpoint.state"),
        **dict.fromkeys(_FILES, "acceltrain.checkpoint.files"),
        **dict.fromkeys(_SAFE, "acceltrain.checkpoint.safe_load"),
    },
)
