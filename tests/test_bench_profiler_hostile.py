"""Issue 20: a --profile-steps range past the end of the run, and `acceltrain bench` arguments that no row
could run with (refused in one line, exit 2, before any row runs and before its output folder exists)."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import REPO, TINY_RECIPE, check, launch, run_tiny_in_process


@pytest.mark.slow
def test_a_profile_range_past_the_end_profiles_the_steps_that_ran_and_exits_cleanly(tmp_path):
    out = tmp_path / "run"
    # fresh process: the segfault was at interpreter exit, with the profiler still running
    check(
        launch(
            TINY_RECIPE,
            [
                "--batch-size",
                "8",
                "--max-steps",
                "3",
                "--profile-steps",
                "1:1000",
                "--output-dir",
                str(out),
                "--no-progress",
                "--report-to",
                "none",
            ],
        )
    )
    assert (out / "profile" / "trace.json").stat().st_size > 0
    top = (out / "profile" / "top_ops.txt").read_text()
    assert top.startswith("optimizer steps 1..3 (asked for 1..1000: the run ended at step 3)")


def test_a_stop_to_be_resumed_mid_range_writes_the_profile_so_far_and_stops_the_profiler(tmp_path):
    out = tmp_path / "run"
    code = run_tiny_in_process(
        out,
        "--batch-size",
        "8",
        "--max-steps",
        "6",
        "--stop-after-steps",
        "2",
        "--profile-steps",
        "1:5",
        "--no-progress",
        "--report-to",
        "none",
    )
    assert code == 75
    assert not torch.autograd.profiler._is_profiler_enabled
    top = (out / "profile" / "top_ops.txt").read_text()
    assert top.startswith("optimizer steps 1..2 (asked for 1..5: the run ended at step 2)")


def test_a_profile_range_that_starts_after_the_last_step_is_refused_before_training(tmp_path, capsys):
    out = tmp_path / "run"
    assert (
        run_tiny_in_process(
            out,
            "--batch-size",
            "8",
            "--max-steps",
            "3",
            "--profile-steps",
            "5:9",
            "--no-progress",
            "--report-to",
            "none",
        )
        == 2
    )
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        "error: --profile-steps '5:9' starts after the run's last step (3): nothing would be profiled; "
        "give A:B with A <= 3"
    )
    assert not out.exists()


@pytest.fixture
def no_rows(monkeypatch):
    """Fails the test if a row would run; the rows bench would have run otherwise (a valid command line)."""
    from acceltrain.commands import bench, recipe_loading

    ran = []

    def run_row(row, args, out, position):
        ran.append(row.name)
        row.status = "skipped: not run by this test"

    monkeypatch.setattr(bench, "run_row", run_row)
    yield ran
    sys.modules.pop(recipe_loading.RECIPE_MODULE, None)  # a --recipe script bench imported to read its config class


def refusal(capsys, *argv: str, output_dir) -> str:
    from acceltrain.commands.bench import main as bench_main

    assert bench_main([*argv, "--output-dir", str(output_dir)]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert captured.out == ""
    return line


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--bogus", "1"],
            "error: unrecognized arguments: --bogus (did you mean --rows?) 1 (neither a bench flag nor one of "
            "the recipe's: acceltrain bench --help, and the recipe's --help)",
        ),
        (
            ["--rosw", "fp32"],
            "error: unrecognized arguments: --rosw (did you mean --rows?) fp32 (neither a bench flag nor one "
            "of the recipe's: acceltrain bench --help, and the recipe's --help)",
        ),
        (
            ["--stem", "imagenet", "--lr-schedul", "cosine"],
            "error: unrecognized arguments: --lr-schedul (did you mean "
            "--lr-schedule?) cosine (neither a bench flag nor one of the recipe's: "
            "acceltrain bench --help, and the recipe's --help)",
        ),
        (
            ["--step", "3"],
            "error: unrecognized arguments: --step (did you mean --steps?) 3 (neither a bench flag nor one of "
            "the recipe's: acceltrain bench --help, and the recipe's --help)",
        ),
        (["--steps", "many"], "error: argument --steps: invalid int value: 'many'"),
        (["--processes", "1,two"], "error: --processes '1,two' is invalid: a comma list of integers >= 1, e.g. 1,2"),
    ],
)
def test_bench_refuses_an_unknown_flag_or_bad_value_before_any_row(tmp_path, capsys, no_rows, argv, expected):
    assert refusal(capsys, *argv, output_dir=tmp_path / "bench") == expected
    assert no_rows == [] and not (tmp_path / "bench").exists()


def test_bench_refuses_a_model_the_recipe_does_not_know_before_any_row(tmp_path, capsys, no_rows):
    line = refusal(capsys, "--model", "nope", output_dir=tmp_path / "bench")
    assert line.startswith("error: --model 'nope'") and "resnet_tiny" in line
    assert no_rows == [] and not (tmp_path / "bench").exists()


def test_bench_refuses_a_recipe_that_is_not_a_python_recipe(tmp_path, capsys, no_rows):
    passwd = tmp_path / "passwd"
    passwd.write_text("root:x:0:0:root:/root:/bin/bash\n")
    no_main = tmp_path / "no_main.py"
    no_main.write_text("VALUE = 1\n")
    no_config = tmp_path / "no_config.py"
    no_config.write_text("def main(cfg):\n    pass\n")
    assert refusal(capsys, "--recipe", str(passwd), output_dir=tmp_path / "bench") == (
        f"error: --recipe {str(passwd)!r} cannot be loaded as a Python recipe: invalid syntax (passwd, line 1)"
    )
    assert refusal(capsys, "--recipe", str(no_main), output_dir=tmp_path / "bench") == (
        f"error: --recipe {str(no_main)!r} has no main(cfg): a recipe is a config class (a TrainConfig subclass), "
        "main(cfg) and cli(), as acceltrain.recipes.resnet_cifar"
    )
    assert refusal(capsys, "--recipe", "acceltrain.vision.names", output_dir=tmp_path / "bench").startswith(
        "error: --recipe 'acceltrain.vision.names' has no main(cfg)"
    )
    assert refusal(capsys, "--recipe", str(no_config), output_dir=tmp_path / "bench") == (
        f"error: --recipe {str(no_config)!r} has no config class: annotate main(cfg: YourConfig) with a TrainConfig "
        "subclass"
    )
    assert no_rows == [] and not (tmp_path / "bench").exists()


@pytest.mark.parametrize("where", ["a file", "under /proc"])
def test_bench_refuses_an_output_dir_it_cannot_write_before_any_row(tmp_path, capsys, no_rows, where):
    target = tmp_path / "taken" if where == "a file" else "/proc/acceltrain-bench"
    if where == "a file":
        target.write_text("mine")
    line = refusal(capsys, "--rows", "fp32", output_dir=target)
    assert line.startswith(f"error: --output-dir {str(target)!r} cannot be written: ")
    assert no_rows == []
    if where == "a file":
        assert target.read_text() == "mine"


def test_bench_refuses_a_recipe_without_the_flags_it_gives_every_row(tmp_path, capsys, no_rows):
    assert refusal(capsys, "--recipe", str(TINY_RECIPE), output_dir=tmp_path / "bench") == (
        f"error: --recipe {str(TINY_RECIPE)!r} has no --model, --dataset: bench gives every row --model and --dataset "
        "(as acceltrain.recipes.resnet_cifar takes them)"
    )
    assert no_rows == [] and not (tmp_path / "bench").exists()


@pytest.mark.parametrize("recipe", ["acceltrain.recipes.resnet_cifar", str(REPO / "recipes" / "resnet_cifar.py")])
def test_bench_runs_the_rows_of_a_valid_recipe_with_its_own_flags(tmp_path, no_rows, recipe):
    from acceltrain.commands.bench import main as bench_main

    argv = [
        "--recipe",
        recipe,
        "--rows",
        "fp32",
        "--stem",
        "imagenet",
        "--no-whiten-first-conv",
        "--output-dir",
        str(tmp_path / "bench"),
    ]
    assert bench_main(argv) == 0
    assert no_rows == ["fp32"]


@pytest.mark.parametrize(
    ("cuda", "expected"),
    [
        (
            False,
            "error: --processes '1,10000' asks for 10000 processes: this machine runs at most 2 (one per CPU core)",
        ),
        (True, "error: --processes '1,10000' asks for 10000 processes: this machine runs at most 1 (one per GPU)"),
    ],
)
def test_bench_refuses_more_processes_than_the_machine_runs_before_any_row(
    tmp_path, capsys, monkeypatch, no_rows, cuda, expected
):
    """Issue 31 item 12: --processes 10000 on 2 cores started the ladder, then torchrun's 10000 processes."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert refusal(capsys, "--processes", "1,10000", output_dir=tmp_path / "bench") == expected
    assert no_rows == [] and not (tmp_path / "bench").exists()
