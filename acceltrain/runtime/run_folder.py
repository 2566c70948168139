"""The run folder: its name, its files, one live run at a time (a lock), and nothing left behind by bad input.

A launch claims its folder once (:func:`claim_run_folder`), before it writes anything: a recipe that writes a
tokenizer there before training claims it first, and ``fit()`` gets the same claim. The claim remembers what the
folder held before, so that bad input found later removes only what this launch added; once training has
started, nothing is removed (checkpoints, metrics and tokenizer stay for ``--resume auto``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

from acceltrain.config.options import ConfigError, parse_json
from acceltrain.config.train_config import TrainConfig

# Free of torch and Accelerate at import (they are imported where used): the recipes' --help and the option groups
# read the run's file names from here.

# The files a run writes at the top of its folder (other modules import the names from here)
WEIGHTS_FILE = "model.safetensors"
SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
ADAPTER_CONFIG_FILE = "adapter_config.json"  # a PEFT adapter folder's (peft's own names)
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_SETTINGS_FILE = (
    "adapter_base_settings.json"  # what training changed in the base model's config (its new labels)
)
CARD_FILE = "README.md"
TRAIN_CONFIG_FILE = "train_config.yaml"
CURVES_FILE = "curves.png"
MEMORY_FILE = "memory.json"  # --memory-report's rows
REPORT_FILE = "classification_report.json"  # a classifier's per-class figures and its class names
CHECKPOINTS_DIR = "checkpoints"
LOCK_FILE = ".lock"
# In a folder that no acceltrain run has used (no .lock) these would replace the user's own (--output-dir . in a
# checkout: its README.md)
RUN_FILES = (
    WEIGHTS_FILE,
    SUMMARY_FILE,
    METRICS_FILE,
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    CARD_FILE,
    TRAIN_CONFIG_FILE,
    CURVES_FILE,
    MEMORY_FILE,
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    ADAPTER_SETTINGS_FILE,
)


@dataclasses.dataclass
class RunFolder:
    """A launch's claim on its output folder, and the process facts known before any data is loaded."""

    cfg: TrainConfig  # with output_dir resolved
    output_dir: Path
    is_main_process: bool
    num_processes: int
    found: (
        frozenset[str] | None
    )  # the folder's entries when this launch locked it (main process); None: this launch made the folder
    trained: bool = False  # training has started: from then on a failure keeps everything (fit() sets it)
    _depth: int = 0  # nested left_as_found blocks (a recipe's around fit()'s): the outermost one lets go

    @contextlib.contextmanager
    def left_as_found(self):
        """Bad input found inside (a Hub refusal in ``on_fit_start``, a checkpoint that does not fit, rows a recipe
        cannot tokenise) leaves nothing behind: before training started, the main process removes what this launch
        added to the folder, and the folder itself if this launch made it. Nothing the folder held before is touched,
        and nothing at all once training has started: a failed save must not delete the run. The folder's lock,
        held since the claim, is released when the outermost block ends: no other launch can write there between
        the claim and the clean-up."""
        self._depth += 1
        try:
            yield
        except Exception:
            if self.is_main_process and not self.trained and self._depth == 1:
                remove_added(self.output_dir, self.found)
            raise
        finally:
            self._depth -= 1
            if self._depth == 0:
                _CLAIMS.pop(_key(self.output_dir), None)
                unlock_output_dir(self.output_dir)


_CLAIMS: dict[str, RunFolder] = {}  # this process's live claims, by resolved folder


def claim_run_folder(cfg: TrainConfig, name: str, task=None) -> RunFolder:
    """What every run does before it loads data: join the process group (refusing silent fallbacks), agree on
    the output folder (refusing to replace a finished run or files it did not write), and refuse a ``task`` that
    cannot work on this backend. ``fit()`` calls it; a recipe that writes into the output folder before training
    (a tokenizer) calls it first, and ``fit()`` then continues that claim."""
    from acceltrain.runtime.distributed import init_process_state, main_process_only

    state = init_process_state(cfg, task)  # what the engine cannot run is one line before its start-up
    output_dir = resolve_output_dir(cfg, name)
    claimed = _CLAIMS.get(_key(output_dir))
    if claimed is not None:
        return claimed
    found = [None]
    main_process_only(lambda: found.__setitem__(0, _claim(output_dir, cfg.overwrite)))
    folder = RunFolder(
        dataclasses.replace(cfg, output_dir=str(output_dir)),
        output_dir,
        state.is_main_process,
        state.num_processes,
        found[0],
    )
    _CLAIMS[_key(output_dir)] = folder
    return folder


def _key(output_dir: Path) -> str:
    return str(Path(output_dir).resolve())


def _claim(output_dir: Path, overwrite: bool) -> frozenset[str] | None:
    """Refuse a folder that a live run holds, or one whose files the run would replace though no run wrote
    them; with ``--overwrite``, move the previous run aside. Then lock the folder, making it if needed, and return
    what it held when locked (None: this launch made it), so that bad input found later removes only this launch's
    own files: the lock keeps every other launch out from that moment on."""
    _refuse_foreign(output_dir)
    if overwrite:
        aside = move_previous_run_aside(output_dir)
        if aside is not None:
            from accelerate.logging import get_logger

            get_logger(__name__).info(f"--overwrite: moved the previous run in {output_dir} to {aside}")
    made_folder, made_lock = lock_output_dir(output_dir)
    if made_folder:
        return None
    return frozenset(os.listdir(output_dir)) - ({LOCK_FILE} if made_lock else set())


def _refuse_foreign(output_dir: Path) -> None:
    if output_dir.is_dir() and not (output_dir / LOCK_FILE).exists():
        foreign = [name for name in RUN_FILES if (output_dir / name).exists()]
        if foreign:
            raise ConfigError(
                f"--output-dir {str(output_dir)!r} holds {', '.join(foreign)}, not written by an acceltrain run, which "
                "this run would replace: choose a new or empty --output-dir"
            )


def _refuse_finished(output_dir: Path, overwrite: bool, resume) -> None:
    if (output_dir / SUMMARY_FILE).exists() and not (overwrite or resume):
        raise ConfigError(
            f"--output-dir {str(output_dir)!r} already holds a finished run ({SUMMARY_FILE}); "
            "pass --resume auto to continue it, --overwrite to replace it, or choose another --output-dir"
        )


def check_claimable(output_dir: Path, overwrite: bool, resume: bool) -> Path | None:
    """For a launcher that writes into its runs' folder before they claim it (``acceltrain ft-launch``): the one line
    their claim would give, before anything is written there (a folder another live run holds, files no run wrote, a
    finished run); with ``overwrite``, the previous run moved aside now (returned), for the runs to start clean."""
    _refuse_foreign(output_dir)
    _refuse_finished(output_dir, overwrite, resume)
    if (output_dir / LOCK_FILE).exists():
        lock_output_dir(output_dir)  # one line when a live run holds it
        unlock_output_dir(output_dir)
    return move_previous_run_aside(output_dir) if overwrite else None


def remove_added(output_dir: Path, found: frozenset[str] | None) -> None:
    """What this launch added to ``output_dir`` since ``found`` (None: the folder itself), removed while no other
    launch can write there (a run holds the folder's lock; ft-launch's groups have ended)."""
    if not output_dir.is_dir():
        return
    if found is None:
        shutil.rmtree(output_dir, ignore_errors=True)
        return
    for name in set(os.listdir(output_dir)) - found:
        path = output_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def resolve_output_dir(cfg: TrainConfig, recipe_name: str) -> Path:
    """``--output-dir``, or ``runs/<recipe>-<timestamp>`` agreed by all processes. Refuses a folder that
    already holds a finished run unless ``--overwrite``: a typo must not replace last week's results."""
    from accelerate.utils import broadcast_object_list

    if cfg.output_dir is not None:
        output_dir = Path(cfg.output_dir)
    elif cfg.resume is not None:  # --resume PATH: the run folder that holds checkpoints/PATH
        output_dir = Path(cfg.resume).resolve().parent.parent
    else:
        stamp = [time.strftime("%Y%m%d-%H%M%S")]
        broadcast_object_list(stamp, from_process=0)
        output_dir = Path("runs") / f"{recipe_name}-{stamp[0]}"
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"--output-dir {str(output_dir)!r} exists and is not a directory")
    _refuse_finished(output_dir, cfg.overwrite, cfg.resume)
    return output_dir


_HELD_LOCKS: dict[str, int] = {}


def lock_output_dir(output_dir: Path) -> tuple[bool, bool]:
    """Create ``output_dir`` if needed (a one-line ConfigError when it cannot be), and hold an exclusive
    ``flock`` on ``<output_dir>/.lock`` until :func:`unlock_output_dir` or this process
    ends (the kernel drops it when the process dies, so a crash leaves nothing locked). A folder that
    another live run holds is a one-line ConfigError. Again from the same process: a no-op. Returns whether this
    call made the folder and whether it made the lock file."""
    import fcntl
    import socket

    key = _key(output_dir)
    if key in _HELD_LOCKS:
        return False, False
    made_folder = made_lock = False
    try:
        try:
            output_dir.mkdir(parents=True)
            made_folder = True
        except FileExistsError:
            if not output_dir.is_dir():
                raise
        try:
            descriptor = os.open(output_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            made_lock = True
        except FileExistsError:
            descriptor = os.open(output_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:  # below a file, read-only, full
        raise ConfigError(f"--output-dir {str(output_dir)!r} cannot be written: {err.strerror or err}") from None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(descriptor, 200).decode(errors="replace").strip() or "pid unknown"
        os.close(descriptor)
        raise ConfigError(
            f"--output-dir {str(output_dir)!r} is in use by another run ({holder}): wait for it or stop it, "
            "or choose another --output-dir"
        ) from None
    os.ftruncate(descriptor, 0)
    os.write(descriptor, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
    _HELD_LOCKS[key] = descriptor
    return made_folder, made_lock


def unlock_output_dir(output_dir: Path | None = None) -> None:
    """Release this process's lock on ``output_dir`` (all of them when None)."""
    keys = list(_HELD_LOCKS) if output_dir is None else [_key(output_dir)]
    for key in keys:
        descriptor = _HELD_LOCKS.pop(key, None)
        if descriptor is not None:
            os.close(descriptor)


def move_previous_run_aside(output_dir: Path) -> Path | None:
    """``--overwrite``: a folder holding a run (summary, metrics, checkpoints or weights) is renamed to
    ``<name>.overwritten-<time>`` beside it, so that the new run starts clean and nothing of the old one
    is resumed by mistake, nor lost. Refused while a live run holds the folder. Returns the new name."""
    held = (SUMMARY_FILE, METRICS_FILE, CHECKPOINTS_DIR, WEIGHTS_FILE)
    if not output_dir.is_dir() or not any((output_dir / name).exists() for name in held):
        return None
    lock_output_dir(output_dir)
    unlock_output_dir(output_dir)
    aside = output_dir.with_name(f"{output_dir.name}.overwritten-{time.strftime('%Y%m%d-%H%M%S')}")
    os.rename(output_dir, aside)
    return aside


def finished_steps(output_dir: Path) -> int | None:
    """The step count of the finished run in ``output_dir`` (its summary.json), or None."""
    try:
        return int(parse_json((output_dir / SUMMARY_FILE).read_text())["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_summary(output_dir: Path, summary: dict) -> None:
    (output_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, default=str) + "\n")
