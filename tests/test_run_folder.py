"""The run folder holds only what the run wrote: a folder with the user's own files is refused before
anything is replaced, bad input found after the folder was claimed leaves it as it was, and a hook may
evaluate before the first step or after the last one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import read_events, read_summary, run_tiny_in_process

from acceltrain import ConfigError, Hook

sys.path.insert(0, str(Path(__file__).parent / "helpers"))

RUN = [
    "--num-train",
    "16",
    "--batch-size",
    "8",
    "--max-steps",
    "2",
    "--no-progress",
    "--num-workers",
    "0",
    "--report-to",
    "none",
]


@pytest.mark.parametrize("name", ["README.md", "config.json", "train_config.yaml", "curves.png", "model.safetensors"])
def test_a_folder_holding_files_no_run_wrote_is_refused_and_kept(tmp_path, capsys, name):
    out = tmp_path / "project"
    out.mkdir()
    (out / name).write_text("the user's own")
    assert run_tiny_in_process(out, *RUN) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("error: --output-dir") and name in err and "new or empty --output-dir" in err and "\n" not in err
    ), err
    assert (out / name).read_text() == "the user's own"
    assert sorted(p.name for p in out.iterdir()) == [name], "no .lock, nothing else left"


def test_an_existing_folder_with_other_files_is_used_and_a_previous_run_folder_too(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "slurm-123.out").write_text("a launcher's log")
    assert run_tiny_in_process(out, *RUN) == 0
    assert (out / "slurm-123.out").read_text() == "a launcher's log" and (out / "README.md").exists()
    assert run_tiny_in_process(out, *RUN, "--overwrite") == 0, "its own files are not foreign to a later run"


class FailsAtStart(Hook):
    def on_fit_start(self, run):
        raise ConfigError("refused by a hook before step 1")


def test_bad_input_after_the_folder_was_claimed_leaves_nothing_behind(tmp_path):
    fresh = tmp_path / "fresh"
    assert run_tiny_in_process(fresh, *RUN, hooks=[FailsAtStart()]) == 2
    assert not fresh.exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    assert run_tiny_in_process(existing, *RUN, hooks=[FailsAtStart()]) == 2
    assert sorted(p.name for p in existing.iterdir()) == ["notes.txt"]


class Evaluates(Hook):
    """A baseline evaluation before step 1 and one more after the run."""

    def __init__(self):
        self.results = {}

    def on_fit_start(self, run):
        self.results["start"] = (run.step, run.evaluate())

    def on_fit_end(self, run, summary):
        self.results["end"] = (run.step, run.evaluate())
        summary["eval_after_fit"] = self.results["end"][1]["eval_accuracy"]


def test_a_hook_evaluates_before_the_first_step_and_after_the_last(tmp_path):
    hook = Evaluates()
    assert run_tiny_in_process(tmp_path, *RUN, hooks=[hook]) == 0
    assert hook.results["start"][0] == 0 and "eval_accuracy" in hook.results["start"][1]
    assert hook.results["end"][0] == 2
    eval_rows = [row for row in read_events(tmp_path) if "eval_accuracy" in row]
    assert [row["step"] for row in eval_rows] == [0, 2, 2], "the baseline, the loop's final evaluation, the hook's"
    assert eval_rows[0]["wall_seconds"] == 0.0, "before the clock starts"
    assert read_summary(tmp_path)["eval_after_fit"] == eval_rows[-1]["eval_accuracy"]


def test_a_refused_launch_never_deletes_a_folder_another_launch_filled(tmp_path):
    """Before: claiming a folder that did not exist took no lock, so a second launch could create it, train,
    checkpoint and exit while the first was still loading; the first one's bad input then removed the whole folder
    with the other run's checkpoints. The claim now holds the folder's lock from the moment it creates it."""
    from conftest import TINY_RECIPE, launch

    from acceltrain import TrainConfig, claim_run_folder

    out = tmp_path / "shared"
    folder = claim_run_folder(TrainConfig(output_dir=str(out), report_to="none"), "b")
    other = launch(
        TINY_RECIPE,
        [*RUN, "--max-steps", "6", "--stop-after-steps", "4", "--save-every-steps", "2", "--output-dir", str(out)],
    )
    with pytest.raises(ConfigError), folder.left_as_found():
        raise ConfigError("bad input found while loading")
    if other.returncode != 2:  # the other launch ran: whatever it wrote must still be there
        assert (out / "checkpoints").is_dir(), f"the other run's checkpoints were deleted (exit {other.returncode})"
    err = other.stderr.strip().splitlines()
    assert other.returncode == 2 and err[-1].startswith("error: --output-dir") and "in use by another run" in err[-1]
    assert not out.exists(), "the folder this launch made, and only it wrote into, is removed"
