"""``acceltrain sweep``'s study: its storage (a journal file in the study folder, or a shared RDB), what makes it one
study (recipe, flags, parameters, metric), the locks that let several workers share it, and its results: sweep.json,
trials.csv, history.png, importance.png and the table ``--show`` prints."""

from __future__ import annotations

import contextlib
import csv
import fcntl
import json
import math
import os
from pathlib import Path

from acceltrain.config.options import ConfigError

JOURNAL_FILE = "study.journal"
SWEEP_FILE = "sweep.json"
TRIALS_FILE = "trials.csv"
HISTORY_FILE = "history.png"
IMPORTANCE_FILE = "importance.png"
LOCK_FILE = ".sweep.lock"
CLAIMS_DIR = ".claims"
IDENTITY_KEY = "acceltrain_sweep"  # the study's user attribute that says what it is
FAILED_LINE = "error"  # a failed trial's user attribute: its one line
CONFIG_ERROR = "config_error"  # a failed trial whose bad input is every trial's: not one of the N


def trial_folder(study_dir: Path, number: int) -> Path:
    return study_dir / f"trial_{number:04d}"


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive ``flock`` on ``path`` while inside: one worker at a time counts, asks and tells (so that the study
    gets exactly N trials), the kernel's to release when a worker dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)


class Claim:
    """A worker's hold on one trial: a non-blocking ``flock`` on ``.claims/trial_NNNN.lock`` for as long as it runs
    the trial. A RUNNING trial whose claim is free has no live worker (it was preempted): the next worker resumes it."""

    def __init__(self, study_dir: Path, number: int):
        self.path = study_dir / CLAIMS_DIR / f"trial_{number:04d}.lock"
        self.descriptor: int | None = None

    def take(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            return False
        self.descriptor = descriptor
        return True

    def release(self) -> None:
        if self.descriptor is not None:
            os.close(self.descriptor)
            self.descriptor = None


def storage_spec(study_dir: Path, storage: str | None) -> str:
    """``--storage``, or the study folder's own journal file."""
    from acceltrain.hooks.pruning import JOURNAL_PREFIX

    return storage or f"{JOURNAL_PREFIX}{(study_dir / JOURNAL_FILE).resolve()}"


def load_study(spec: str, study_name: str):
    """The study in ``spec``, or None when it holds none of that name."""
    import optuna

    from acceltrain.hooks.pruning import open_storage

    try:
        return optuna.load_study(study_name=study_name, storage=open_storage(spec))
    except KeyError:
        return None


def create_study(spec: str, study_name: str, identity: dict):
    import optuna

    from acceltrain.hooks.pruning import open_storage

    study = optuna.create_study(
        storage=open_storage(spec), study_name=study_name, direction=identity["direction"], load_if_exists=True
    )
    if IDENTITY_KEY not in study.user_attrs:
        study.set_user_attr(IDENTITY_KEY, identity)
    return study


def check_identity(study, identity: dict, study_dir: Path, given: dict) -> dict:
    """The study found must be this command's: the same recipe, recipe flags and parameters, and the metric and
    direction when given; else one line naming the first difference. Returns the study's own identity (its
    metric and direction as resolved when it began)."""
    saved = study.user_attrs.get(IDENTITY_KEY)
    if saved is None:
        raise ConfigError(
            f"--study-dir {str(study_dir)!r}: its storage holds a study {study.study_name!r} that acceltrain sweep did "
            "not start: choose another --study-dir"
        )
    names = {"recipe": "recipe", "recipe_args": "recipe flags", "params": "parameters"}
    for key, label in names.items():
        if saved[key] != identity[key]:
            raise _another_study(study_dir, label, saved[key], identity[key])
    for key in ("metric", "direction"):
        if given.get(key) is not None and given[key] != saved[key]:
            raise _another_study(study_dir, f"--{key}", saved[key], given[key])
    return saved


def _another_study(study_dir: Path, what: str, saved, now) -> ConfigError:
    def shown(value):
        if isinstance(value, dict):
            return " ".join(f"{name}={spec}" for name, spec in value.items()) or "none"
        return " ".join(value) or "none" if isinstance(value, list) else str(value)

    return ConfigError(
        f"--study-dir {str(study_dir)!r} holds another study: its {what} are {shown(saved)!r}, this command's "
        f"{shown(now)!r}; continue it with the same settings, or choose another --study-dir"
    )


def sampler(kind: str, params: list, seed: int, trials_so_far: int):
    """The sampler for the next ask, seeded from --seed and the trials so far: a sweep resumed after a preemption asks
    what the one never stopped would have asked, and never the first trial's parameters again."""
    import optuna

    if kind == "random":
        return optuna.samplers.RandomSampler(seed=seed + trials_so_far)
    if kind == "grid":
        grid = {
            p.name: list(p.choices) if p.kind == "choice" else list(range(int(p.low), int(p.high) + 1)) for p in params
        }
        # its grid order is shuffled by the seed, and trial N takes point N of it: the seed alone, never moved
        return optuna.samplers.GridSampler(grid, seed=seed)
    return optuna.samplers.TPESampler(seed=seed + trials_so_far)


def tell(study, number: int, trial_id: int, ended: tuple, common: bool) -> None:
    """The study told how trial ``number`` ended: ``ended`` is (state, value, the failed trial's line)."""
    import optuna
    from optuna.trial import TrialState

    state, value, line = ended
    # the grid sampler stops an optimize() loop once its grid is done: outside one, that is an error
    study.sampler = optuna.samplers.RandomSampler()
    if state == "complete":
        study.tell(number, value)
    elif state == "pruned":
        study.tell(number, state=TrialState.PRUNED)
    else:
        trial = optuna.trial.Trial(study, trial_id)
        trial.set_user_attr(FAILED_LINE, line)
        if common:
            trial.set_user_attr(CONFIG_ERROR, True)
        study.tell(number, state=TrialState.FAIL)


def counted(trials) -> list:
    """The study's trials that count towards --trials: all but those stopped by bad input common to every trial."""
    return [trial for trial in trials if not trial.user_attrs.get(CONFIG_ERROR)]


def state_counts(trials) -> dict[str, int]:
    counts = {"complete": 0, "pruned": 0, "failed": 0, "running": 0}
    for trial in counted(trials):
        key = {"COMPLETE": "complete", "PRUNED": "pruned", "FAIL": "failed"}.get(trial.state.name, "running")
        counts[key] += 1
    return counts


def best_trial(study):
    complete = [t for t in counted(study.trials) if t.state.name == "COMPLETE" and t.value is not None]
    if not complete:
        return None
    maximize = study.direction.name == "MAXIMIZE"
    return (max if maximize else min)(complete, key=lambda trial: (trial.value, -trial.number))


def results(study, study_dir: Path, identity: dict, wanted: int, spec: str) -> dict:
    """sweep.json's content: the best trial (parameters, value, folder) and the counts by state."""
    from acceltrain.hooks.pruning import shown_url

    best = best_trial(study)
    counts = state_counts(study.trials)
    return {
        "study": study.study_name,
        "storage": shown_url(spec),
        "recipe": identity["recipe"],
        "metric": identity["metric"],
        "direction": identity["direction"],
        "trials": wanted,
        "finished": sum(counts[key] for key in ("complete", "pruned", "failed")) >= wanted,
        "counts": counts,
        "best": None
        if best is None
        else {
            "trial": best.number,
            "value": best.value,
            "params": best.params,
            "folder": str(trial_folder(study_dir, best.number).resolve()),
        },
    }


def write_results(study, study_dir: Path, identity: dict, wanted: int, spec: str) -> dict:
    """sweep.json and trials.csv, each replaced whole (a reader never sees half a file). Returns sweep.json's
    content."""
    result = results(study, study_dir, identity, wanted, spec)
    _replace(study_dir / SWEEP_FILE, json.dumps(result, indent=2) + "\n")
    temporary = study_dir / f".{TRIALS_FILE}.tmp"
    with temporary.open("w", newline="") as handle:
        csv.writer(handle).writerows(table_rows(study, identity))
    temporary.replace(study_dir / TRIALS_FILE)
    return result


def _replace(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    temporary.replace(path)


def table_rows(study, identity: dict) -> list[list[str]]:
    """A header and one row per trial: number, state, value, each parameter, folder, what ended it."""
    names = list(identity["params"])
    rows = [["trial", "state", identity["metric"], *names, "folder", "note"]]
    for trial in study.trials:
        state = trial.state.name.lower()
        if trial.user_attrs.get(CONFIG_ERROR):
            state = "failed (bad input of every trial; not counted)"
        value = "" if trial.value is None else f"{trial.value:.6g}"
        if trial.state.name == "PRUNED" and trial.intermediate_values:
            step, last = max(trial.intermediate_values.items())
            note = f"pruned at step {step} ({last:.4g})"
        else:
            note = trial.user_attrs.get(FAILED_LINE, "")
        params = [_shown_value(trial.params.get(name)) for name in names]
        rows.append([str(trial.number), state, value, *params, f"trial_{trial.number:04d}", note])
    return rows


def _shown_value(value) -> str:
    if value is None:
        return ""
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def print_table(study, identity: dict, result: dict) -> None:
    rows = table_rows(study, identity)
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[-1])
    counts = ", ".join(f"{count} {state}" for state, count in result["counts"].items())
    print(f"{counts}, of {result['trials']} trials")
    best = result["best"]
    if best:
        params = " ".join(f"{name}={_shown_value(value)}" for name, value in best["params"].items())
        print(f"best: trial {best['trial']}, {result['metric']} {best['value']:.6g}, {params}, in {best['folder']}")


def draw_plots(study, study_dir: Path, identity: dict) -> None:
    """history.png: each finished trial's value and the best so far; importance.png: Optuna's parameter importances,
    when it can compute them (two complete trials at least, a parameter that varies). matplotlib's Figure, no pyplot."""
    from matplotlib.figure import Figure

    done = [t for t in counted(study.trials) if t.state.name == "COMPLETE" and t.value is not None]
    if not done:
        return
    maximize = identity["direction"] == "maximize"
    best, running = [], None
    for trial in done:
        running = trial.value if running is None else (max if maximize else min)(running, trial.value)
        best.append(running)
    figure = Figure(figsize=(6, 4))
    axes = figure.subplots()
    axes.plot([t.number for t in done], [t.value for t in done], "o", label="trial")
    axes.step([t.number for t in done], best, where="post", label="best so far")
    axes.set_xlabel("trial")
    axes.set_ylabel(identity["metric"])
    axes.legend()
    figure.savefig(study_dir / HISTORY_FILE, dpi=100)
    importances = _importances(study)
    if importances:
        figure = Figure(figsize=(6, 1 + 0.5 * len(importances)))
        axes = figure.subplots()
        axes.barh(list(importances)[::-1], list(importances.values())[::-1])
        axes.set_xlabel(f"importance for {identity['metric']}")
        figure.tight_layout()
        figure.savefig(study_dir / IMPORTANCE_FILE, dpi=100)


def _importances(study) -> dict[str, float]:
    import warnings

    import optuna

    try:
        with warnings.catch_warnings():  # "importances will be equal" and the like: the picture says it
            warnings.simplefilter("ignore")
            importances = optuna.importance.get_param_importances(study)
    except Exception:  # noqa: BLE001 - too few trials, no variance, or an evaluator's dependency missing: no picture
        return {}
    return {name: value for name, value in importances.items() if math.isfinite(value)}


def read_trial_summary(folder: Path) -> dict | None:
    try:
        return json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError):
        return None
