"""The typed config: flags, YAML presets, precedence, and one-line errors (exit 2, nothing written) on bad input."""

from __future__ import annotations

import sys

import pytest
from conftest import RECIPE, check, launch

from acceltrain import ConfigError, TrainConfig, parse_config, run_recipe

sys.path.insert(0, str(RECIPE.parent))
from resnet_cifar import CifarConfig  # noqa: E402
from resnet_cifar import main as cifar_main


def test_defaults_preset_and_flags_take_precedence_in_that_order(tmp_path):
    preset = tmp_path / "preset.yaml"
    preset.write_text("batch-size: 32\nlr: 0.5\nmodel: resnet34\nsync_bn: true\nmax_steps: 7\n")
    cfg = parse_config(CifarConfig, ["--config", str(preset), "--lr", "0.25", "--no-sync-bn"])
    assert (cfg.batch_size, cfg.lr, cfg.model, cfg.sync_bn, cfg.max_steps) == (32, 0.25, "resnet34", False, 7)
    assert cfg.grad_accum == TrainConfig.grad_accum  # untouched default


def test_optional_values_accept_none():
    assert parse_config(TrainConfig, ["--max-steps", "none"]).max_steps is None


BAD_INPUTS = [
    (["--batch-size", "0"], "--batch-size 0 is invalid: must be an integer >= 1"),
    (["--grad-accum", "0"], "--grad-accum 0 is invalid"),
    (["--lr", "-0.1"], "--lr -0.1 is invalid: must be a number > 0"),
    (["--batch-size", "ten"], "--batch-size 'ten' is invalid: must be an integer"),
    (["--model", "resnet9000"], "--model 'resnet9000' is invalid: choose one of resnet18, resnet34, resnet50"),
    (
        ["--dataset", "mnist"],
        "--dataset 'mnist' is invalid: must be one of cifar10, imagefolder, synthetic, or a Hub dataset as "
        "namespace/name",
    ),
    (["--mixed-precision", "fp8"], "--mixed-precision 'fp8' is invalid"),
    (["--target-accuracy", "94"], "--target-accuracy 94.0 is invalid: must be a fraction in (0, 1]"),
    (["--bogus-flag", "1"], "unrecognized arguments: --bogus-flag"),
    (["--config", "/nonexistent/preset.yaml"], "--config '/nonexistent/preset.yaml' cannot be read"),
    # issue "every bad input is one line", item 3: each of these ran or crashed later
    (["--epochs", "inf"], "--epochs 'inf' is invalid: must be a finite number"),
    (["--lr", "nan"], "--lr 'nan' is invalid: must be a finite number"),
    (["--seed", "-1"], "--seed -1 is invalid: must be an integer in [0, 4294967295]"),
    (
        ["--seed", "100000000000000000000"],
        "--seed 100000000000000000000 is invalid: must be an integer in [0, 4294967295]",
    ),
    (["--max-step", "5"], "unrecognized arguments: --max-step (did you mean --max-steps?)"),
    (["--lookahead-decay", "1"], "--lookahead-decay 1.0 is invalid: must be a number in (0, 1)"),
    (["--lookahead-every", "0"], "--lookahead-every 0 is invalid: must be an integer >= 1"),
    (["--min-lr-rate", "1"], "--min-lr-rate 1.0 is invalid: must be a number in [0, 1)"),
    (["--warmup-start-rate", "-0.1"], "--warmup-start-rate -0.1 is invalid: must be a number in [0, 1)"),
]


@pytest.mark.parametrize("argv,message", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_flags_are_one_line_errors(argv, message):
    with pytest.raises(ConfigError) as err:
        parse_config(CifarConfig, argv)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "err,line",
    [
        (OSError(28, "No space left on device"), "No space left on device"),
        (ValueError(""), "ValueError"),
        (RuntimeError("first\nsecond"), "first"),
        (KeyError("x" * 500), "'" + "x" * 299),
    ],
)
def test_an_exception_quoted_in_a_message_is_one_short_line(err, line):
    """An empty message used to raise IndexError inside the error path (the W&B key check, --hub-model-id)."""
    from acceltrain.config.options import first_line

    assert first_line(err) == line


@pytest.mark.parametrize(
    "text,message",
    [
        ("batch_size: 32\nlearning_rate: 0.1\n", "unknown key 'learning_rate'"),
        ("batch_size: [1, 2\n", "is not valid YAML"),
        ("- just\n- a list\n", "must be a mapping"),
        ("batch_size: 1.5\n", "--batch-size 1.5 is invalid: must be an integer"),
        ("config: other.yaml\n", "unknown key 'config'"),
        # issue "every bad input is one line", item 3: each of these ran or crashed later
        ("output_dir: [x, y]\n", "--output-dir ['x', 'y'] is invalid: must be one string, not a list"),
        ("seed: 1e20\n", "--seed '1e20' is invalid: must be an integer"),
        ("batch_size: 32\nbatch_size: 64\n", "duplicate key 'batch_size'"),
        (
            "bach_size: 32\nlearning_rate: 0.1\n",
            "unknown keys 'bach_size' (did you mean 'batch_size'?), 'learning_rate'",
        ),
    ],
)
def test_bad_presets_are_one_line_errors(tmp_path, text, message):
    preset = tmp_path / "preset.yaml"
    preset.write_text(text)
    with pytest.raises(ConfigError) as err:
        parse_config(CifarConfig, ["--config", str(preset)])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_unknown_preset_key_suggests_the_close_one(tmp_path):
    preset = tmp_path / "preset.yaml"
    preset.write_text("bach_size: 32\n")
    with pytest.raises(ConfigError, match="did you mean 'batch_size'"):
        parse_config(CifarConfig, ["--config", str(preset)])


def _run_bad(argv, tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        run_recipe(cifar_main, CifarConfig, argv + ["--output-dir", str(out), "--no-progress"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert not out.exists(), "bad input must not write anything"
    return err


def test_imagefolder_needs_a_data_dir(tmp_path, capsys):
    assert "--dataset imagefolder needs --data-dir" in _run_bad(["--dataset", "imagefolder"], tmp_path, capsys)


def test_malformed_imagefolder_is_rejected(tmp_path, capsys):
    for name in ("cat", "dog"):
        (tmp_path / "folder" / "train" / name).mkdir(parents=True)
    err = _run_bad(["--dataset", "imagefolder", "--data-dir", str(tmp_path / "folder")], tmp_path, capsys)
    assert "holds no images" in err


def test_imagefolder_without_test_split_is_rejected(tmp_path, capsys, image_folder):
    import shutil

    shutil.rmtree(image_folder / "test")
    assert "has no test/ folder" in _run_bad(
        ["--dataset", "imagefolder", "--data-dir", str(image_folder)], tmp_path, capsys
    )


def test_fp16_on_cpu_is_rejected(tmp_path, capsys):
    err = _run_bad(["--dataset", "synthetic", "--mixed-precision", "fp16"], tmp_path, capsys)
    assert "fp16 needs a CUDA GPU" in err


def test_batch_larger_than_dataset_is_rejected_before_writing(tmp_path, capsys):
    err = _run_bad(["--dataset", "synthetic", "--model", "resnet_tiny", "--batch-size", "4096"], tmp_path, capsys)
    assert "--batch-size 4096 is too large" in err


def test_cifar_offline_names_the_ways_out(tmp_path, capsys, monkeypatch):
    import urllib.error

    import torchvision.datasets.utils as tv_utils

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(tv_utils, "urlretrieve", offline, raising=False)
    monkeypatch.setattr(tv_utils, "_urlretrieve", offline, raising=False)
    monkeypatch.setattr(tv_utils, "download_url", offline)
    import torchvision.datasets.cifar as tv_cifar

    monkeypatch.setattr(tv_cifar, "download_and_extract_archive", offline)
    err = _run_bad(["--dataset", "cifar10", "--data-dir", str(tmp_path / "empty")], tmp_path, capsys)
    assert "--data-dir" in err and "--dataset synthetic" in err


def test_existing_finished_run_is_not_overwritten(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        run_recipe(cifar_main, CifarConfig, ["--dataset", "synthetic", "--output-dir", str(out)])
    assert exit_info.value.code == 2
    assert "already holds a finished run" in capsys.readouterr().err
    assert (out / "summary.json").read_text() == "{}"


@pytest.mark.slow
def test_bad_input_from_the_command_line_exits_2_with_one_line(tmp_path):
    result = launch(RECIPE, ["--batch-size", "0", "--output-dir", str(tmp_path / "out")])
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --batch-size 0 is invalid: must be an integer >= 1"
    assert not (tmp_path / "out").exists()


def test_help_lists_every_flag():
    result = check(launch(RECIPE, ["--help"]))
    for flag in (
        "--batch-size",
        "--grad-accum",
        "--lr-schedule",
        "--target-accuracy",
        "--sync-bn",
        "--report-to",
        "--data-dir",
        "--model",
    ):
        assert flag in result.stdout


def test_recipes_import_only_public_names():
    """Every name a recipe imports from acceltrain is in that module's __all__: recipes are what users copy."""
    import ast
    import importlib

    from conftest import REPO

    for recipe in [*(REPO / "recipes").glob("*.py"), *(REPO / "acceltrain" / "recipes").glob("*.py")]:
        for node in ast.walk(ast.parse(recipe.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "acceltrain":
                public = importlib.import_module(node.module).__all__
                for alias in node.names:
                    assert alias.name in public, f"{recipe.name} imports {node.module}.{alias.name}, not in its __all__"


def test_a_yaml_list_for_a_list_like_field_is_taken_as_its_items(tmp_path):
    preset = tmp_path / "preset.yaml"
    preset.write_text("wandb_tags: [a, b]\n")
    assert parse_config(CifarConfig, ["--config", str(preset)]).wandb_tags == "a,b"


def test_an_output_dir_below_a_file_is_one_line(tmp_path, capsys):
    """Before: a NotADirectoryError traceback."""
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(SystemExit) as exit_info:
        run_recipe(
            cifar_main,
            CifarConfig,
            [
                "--dataset",
                "synthetic",
                "--model",
                "resnet_tiny",
                "--max-steps",
                "1",
                "--no-progress",
                "--report-to",
                "none",
                "--output-dir",
                str(tmp_path / "file" / "run"),
            ],
        )
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "cannot be written: Not a directory" in err and "\n" not in err, err


def test_help_states_each_default_once_and_unset_ones_as_unset():
    """Before: '(default: the CPUs per process less one, at most 8) (default: None)'."""
    from acceltrain.config.parser import build_parser

    helps = {action.dest: action.help for action in build_parser(TrainConfig)._actions}
    assert helps["num_workers"].endswith("(default: the CPUs per process less one, at most 8)")
    assert helps["mixed_precision"].endswith("default: what the accelerate config says")
    assert helps["max_steps"].endswith("(default: unset)") and helps["batch_size"].endswith("(default: 128)")
    assert helps["cpu"].endswith("(default: off)") and helps["progress"].endswith(
        "(default: only when stderr is a terminal, so a log file gets no bar updates)"
    )
    assert all(text.count("default:") == 1 and "None" not in text for dest, text in helps.items() if dest != "help")


@pytest.mark.parametrize("given", [["--lr-schedule", "onecycle"], ["--lr-schedule", "linear"]])
def test_onecycle_is_the_old_name_of_the_linear_schedule(given):
    assert parse_config(TrainConfig, given).lr_schedule == "linear"


def test_a_preset_may_still_say_onecycle(tmp_path):
    preset = tmp_path / "preset.yaml"
    preset.write_text("lr_schedule: onecycle\n")
    assert parse_config(TrainConfig, ["--config", str(preset)]).lr_schedule == "linear"


def test_an_unknown_schedule_names_the_allowed_ones():
    with pytest.raises(ConfigError, match="--lr-schedule 'step' is invalid: choose one of constant, cosine, linear"):
        parse_config(TrainConfig, ["--lr-schedule", "step"])


def test_a_checkpoint_written_under_an_old_schedule_name_resumes_under_the_new_one():
    from acceltrain.config.train_config import TrainConfig, run_changes

    cfg = TrainConfig(lr_schedule="linear")
    assert run_changes({**cfg.to_dict(), "lr_schedule": "onecycle"}, cfg) == {}
    assert run_changes({**cfg.to_dict(), "lr_schedule": "cosine"}, cfg) == {"lr_schedule": ["cosine", "linear"]}
