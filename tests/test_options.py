"""Each built-in hook has its own option group, which its ``from_config`` reads (issue 21, item 6): the
flags and YAML keys users type are unchanged, each group checks its own fields, a hook is built from its
group alone, and a hook of one's own brings its options as one more group."""

from __future__ import annotations

import dataclasses
import re

import pytest
from conftest import docs_example

from acceltrain.config.groups import (
    CheckpointOptions,
    EarlyStoppingOptions,
    EvaluationOptions,
    HubOptions,
    LoggingOptions,
    PlotOptions,
    ProfilingOptions,
    TimeBudgetOptions,
    TrackingOptions,
)
from acceltrain.config.options import ConfigError
from acceltrain.config.parser import parse_config
from acceltrain.config.train_config import LoopOptions, TrainConfig
from acceltrain.hooks import (
    CheckpointSchedule,
    Console,
    Curves,
    Evaluation,
    HubReady,
    MemoryReport,
    Preemption,
    Profiler,
    TargetMetric,
    TimeBudget,
    TrainingLog,
)

# every field TrainConfig had before the options moved next to their hooks: what users type stays the same
FIELDS_BEFORE = """
config batch_size grad_accum epochs max_steps optimizer lr momentum weight_decay muon_lr muon_momentum muon_weight_decay
decay_all_parameters norm_bias_lr_scale lr_schedule warmup_steps warmup_start_rate min_lr_rate max_grad_norm eval_every
eval_samples target_metric target_accuracy time_budget_minutes mixed_precision cpu sync_bn compile compile_mode
channels_last activation_checkpointing data_on_device auto_batch_size keep_effective_batch scale_lr num_workers
prefetch_factor pin_memory peak_tflops profile_steps profile_with_stack memory_report plots save_every_steps
save_every_minutes keep_last keep_best resume stop_after_steps seed output_dir overwrite allow_config_change log_every
timing_warmup_steps progress log_level report_to wandb_project run_name wandb_group wandb_tags wandb_notes wandb_mode
log_model push_to_hub hub_model_id hub_private
""".split()
FIELDS_ADDED = [
    "async_checkpoint",
    "early_stopping_patience",
    "early_stopping_threshold",
    "load_best_at_end",
]  # since (issues 32, 39): new flags, the old ones unchanged

GROUPS = {
    EvaluationOptions: {"eval_every", "eval_samples", "target_metric", "target_accuracy"},
    TimeBudgetOptions: {"time_budget_minutes"},
    EarlyStoppingOptions: {"early_stopping_patience", "early_stopping_threshold"},
    ProfilingOptions: {"profile_steps", "profile_with_stack", "memory_report"},
    CheckpointOptions: {
        "save_every_steps",
        "save_every_minutes",
        "keep_last",
        "keep_best",
        "stop_after_steps",
        "async_checkpoint",
        "load_best_at_end",
    },
    LoggingOptions: {"log_every", "progress"},
    PlotOptions: {"plots"},
    TrackingOptions: {
        "report_to",
        "wandb_project",
        "run_name",
        "wandb_group",
        "wandb_tags",
        "wandb_notes",
        "wandb_mode",
        "log_model",
    },
    HubOptions: {"push_to_hub", "hub_model_id", "hub_private"},
}


def names(cls) -> set[str]:
    return {field.name for field in dataclasses.fields(cls)}


def test_the_flags_users_type_are_unchanged_and_each_belongs_to_one_group():
    assert sorted(names(TrainConfig)) == sorted(FIELDS_BEFORE + FIELDS_ADDED)
    for group, fields in GROUPS.items():
        assert names(group) == fields, group.__name__
    owned = set().union(*GROUPS.values())
    assert names(LoopOptions) == set(FIELDS_BEFORE + FIELDS_ADDED) - owned
    assert [field.name for field in dataclasses.fields(TrainConfig)][:3] == [
        "config",
        "batch_size",
        "grad_accum",
    ]  # --help starts with the loop


@pytest.mark.parametrize(
    ("group", "values", "message"),
    [
        (EvaluationOptions, {"eval_every": 0}, "--eval-every 0 is invalid: must be an integer >= 1"),
        (
            EvaluationOptions,
            {"target_accuracy": 0.9, "target_metric": 0.9},
            "give one of --target-metric and --target-accuracy",
        ),
        (TimeBudgetOptions, {"time_budget_minutes": -1.0}, "--time-budget-minutes -1.0 is invalid"),
        (ProfilingOptions, {"profile_steps": "5:2"}, "--profile-steps '5:2' is invalid"),
        (CheckpointOptions, {"keep_last": 0}, "--keep-last 0 is invalid"),
        (LoggingOptions, {"log_every": 0}, "--log-every 0 is invalid"),
        (HubOptions, {"hub_private": True}, "--hub-private needs --push-to-hub"),
    ],
)
def test_each_group_checks_its_own_fields_alone_and_inside_the_config(group, values, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        group(**values).validate()
    argv = [
        f"--{key.replace('_', '-')}" if value is True else f"--{key.replace('_', '-')}={value}"
        for key, value in values.items()
    ]
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(TrainConfig, argv)


def test_each_builtin_is_built_from_its_own_group_alone():
    evaluation = Evaluation.from_config(EvaluationOptions(eval_every=3), evaluates=True)
    assert evaluation.every == 3 and Evaluation.from_config(EvaluationOptions(), evaluates=False) is None
    assert TargetMetric.from_config(EvaluationOptions(target_metric=0.5), evaluation).target == 0.5
    assert TargetMetric.from_config(EvaluationOptions(target_metric=0.5), None) is None  # nothing to evaluate
    assert TimeBudget.from_config(TimeBudgetOptions(time_budget_minutes=2.0), evaluation).budget == 120.0
    assert TimeBudget.from_config(TimeBudgetOptions(), evaluation) is None
    assert Profiler.from_config(ProfilingOptions(profile_steps="2:3")).range == (2, 3)
    assert Profiler.from_config(ProfilingOptions()) is None and MemoryReport.from_config(ProfilingOptions()) is None
    assert isinstance(MemoryReport.from_config(ProfilingOptions(memory_report=True)), MemoryReport)
    schedule = CheckpointSchedule.from_config(CheckpointOptions(keep_best=True, keep_last=2))
    assert (schedule.keep_best, schedule.keep_last, schedule.save_at_end) == (True, 2, True)
    assert (
        CheckpointSchedule.from_config(CheckpointOptions()).save_at_end is False
    )  # no schedule: the final weights only
    assert Preemption.from_config(CheckpointOptions(stop_after_steps=4)).stop_after_steps == 4
    assert TrainingLog.from_config(LoggingOptions(log_every=7)).every == 7
    assert Console.from_config(LoggingOptions(progress=False), evaluation).evaluation is evaluation
    assert Curves.from_config(PlotOptions(plots=False)) is None
    assert HubReady.from_config(HubOptions(push_to_hub=True)).push is True


def test_a_hook_of_ones_own_brings_its_options_as_one_more_group(tmp_path):
    MyConfig = docs_example("hooks.md", "class WeightNormOptions")["MyConfig"]
    assert parse_config(MyConfig, ["--weight-norm-every", "5", "--eval-every", "2"]).weight_norm_every == 5
    preset = tmp_path / "preset.yaml"
    preset.write_text("weight_norm_every: 7\nlog_every: 3\n")
    cfg = parse_config(MyConfig, ["--config", str(preset)])
    assert (cfg.weight_norm_every, cfg.log_every) == (7, 3)
    with pytest.raises(ConfigError, match=r"^--weight-norm-every 0 is invalid: must be an integer >= 1$"):
        parse_config(MyConfig, ["--weight-norm-every", "0"])
    with pytest.raises(ConfigError, match="--log-every 0 is invalid"):  # the built-in groups still check theirs
        parse_config(MyConfig, ["--log-every", "0"])
    assert [field.name for field in dataclasses.fields(MyConfig)][-1] == "weight_norm_every"  # last in --help
