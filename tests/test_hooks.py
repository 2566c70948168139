"""The hook protocol: the documented order, user hooks that log, save and stop, stateful hooks that
resume byte-identically (EMA among them), and the task protocol checked before any training."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType
from conftest import EventRecorder, read_events, read_summary, run_tiny_in_process
from safetensors.torch import load_file

from acceltrain import EMA, ClassificationTask, ConfigError, Hook, Lookahead
from acceltrain.checkpoint.files import complete_checkpoints
from acceltrain.runtime.preemption import EXIT_PREEMPTED

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
import tiny_recipe  # noqa: E402

# 40 samples, batch 4, accumulate 3: windows of 3, 3, 3 and 1 batches, 4 optimizer steps an epoch.
RUN = [
    "--num-train",
    "40",
    "--batch-size",
    "4",
    "--grad-accum",
    "3",
    "--epochs",
    "3",
    "--lr",
    "0.05",
    "--no-progress",
    "--log-every",
    "2",
    "--eval-every",
    "3",
    "--num-workers",
    "0",
    "--report-to",
    "none",
]


def run_tiny(output_dir: Path, *args: str, hooks=(), task=None) -> int:
    return run_tiny_in_process(output_dir, *RUN, *args, hooks=hooks, task=task)


class Recorder(EventRecorder, Hook):
    pass


def test_hooks_are_called_in_the_documented_order(tmp_path):
    recorder = Recorder()
    assert run_tiny(tmp_path / "run", "--max-steps", "6", "--save-every-steps", "4", hooks=[recorder]) == 0
    assert recorder.events == [
        ("fit_start", 0),
        ("epoch_start", 0),
        ("step_end", 1),
        ("step_end", 2),
        ("log", 2, True),
        ("step_end", 3),
        ("eval_start", 3),
        ("eval_end", 3),
        ("log", 3, False),
        ("step_end", 4),
        ("log", 4, True),
        ("save", "step_00000004"),
        ("log", 4, False),
        ("epoch_start", 1),  # checkpoint_seconds
        ("step_end", 5),
        ("step_end", 6),
        ("log", 6, True),
        ("eval_start", 6),
        ("eval_end", 6),
        ("log", 6, False),
        ("train_end", 6),
        ("save", "step_00000006"),
        ("fit_end", 6),
    ]


class EveryNSteps(Hook):
    """The README's example: log a custom metric every N steps."""

    def __init__(self, every: int):
        self.every = every

    def on_step_end(self, run):
        if run.step % self.every == 0:
            weight_norm = sum(p.detach().norm() ** 2 for p in run.model.parameters()) ** 0.5
            run.log({"step": run.step, "weight_norm": weight_norm.item()})


def test_a_user_hook_logs_its_own_metric(tmp_path):
    assert run_tiny(tmp_path / "run", "--max-steps", "6", hooks=[EveryNSteps(3)]) == 0
    rows = [row for row in read_events(tmp_path / "run") if "weight_norm" in row]
    assert [row["step"] for row in rows] == [3, 6] and all(row["weight_norm"] > 0 for row in rows)


class AddToLogRows(Hook):
    def on_log(self, run, metrics):
        if "loss" in metrics:
            metrics["steps_left"] = run.total_steps - run.step


class StopAt(Hook):
    def __init__(self, step: int, finish: bool):
        self.step, self.finish = step, finish

    def on_step_end(self, run):
        if run.step == self.step:
            run.request_stop("enough", finish=self.finish)


def test_a_hook_adds_to_log_rows_and_finishes_the_run_early(tmp_path):
    assert run_tiny(tmp_path / "run", hooks=[AddToLogRows(), StopAt(5, finish=True)]) == 0
    summary = read_summary(tmp_path / "run")
    assert summary["steps"] == 5 and not (tmp_path / "run" / "checkpoints").exists()
    assert [row["steps_left"] for row in read_events(tmp_path / "run") if "loss" in row] == [10, 8]


def test_a_hook_stop_to_resume_later_checkpoints_and_exits_75(tmp_path):
    assert run_tiny(tmp_path / "run", hooks=[StopAt(5, finish=False)]) == EXIT_PREEMPTED
    assert [p.name for p in complete_checkpoints(tmp_path / "run")] == ["step_00000005"]


class Stateful(Hook):
    """Keeps a tensor (a running sum of the weights after every step) and plain values; writes them at the end."""

    name = "stateful-toy"

    def __init__(self):
        self.total, self.steps, self.history = None, 0, []

    def on_fit_start(self, run):
        if self.total is None:
            self.total = torch.zeros_like(next(run.model.parameters()).detach())

    def on_step_end(self, run):
        self.total += next(run.model.parameters()).detach()
        self.steps += 1
        self.history.append(run.step / 3)

    def on_fit_end(self, run, summary):
        summary["toy_steps"] = self.steps
        from safetensors.torch import save_file

        save_file({"total": self.total}, str(run.output_dir / "toy.safetensors"))
        (run.output_dir / "toy.json").write_text(json.dumps(self.history))

    def state_dict(self):
        return {"total": self.total, "steps": self.steps, "nested": {"history": self.history}}

    def load_state_dict(self, state):
        self.total, self.steps, self.history = state["total"], state["steps"], state["nested"]["history"]


@pytest.mark.parametrize("stop_at", [5, 7])
def test_a_stateful_hook_resumes_byte_identically(tmp_path, stop_at):
    full, part = tmp_path / "full", tmp_path / "part"
    assert run_tiny(full, hooks=[Stateful()]) == 0
    assert run_tiny(part, "--stop-after-steps", str(stop_at), hooks=[Stateful()]) == EXIT_PREEMPTED
    (checkpoint,) = complete_checkpoints(part)
    assert {"stateful-toy.json", "stateful-toy.safetensors"} <= {p.name for p in (checkpoint / "hooks").iterdir()}
    manifest = json.loads((checkpoint / "COMPLETE").read_text())
    assert "hooks/stateful-toy.safetensors" in manifest, "the manifest covers hook state"
    assert run_tiny(part, "--resume", "auto", hooks=[Stateful()]) == 0
    for name in ("toy.safetensors", "toy.json", "model.safetensors"):
        assert (part / name).read_bytes() == (full / name).read_bytes(), name
    assert read_summary(part)["toy_steps"] == 12


def test_resuming_with_another_set_of_stateful_hooks_is_a_one_line_error(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_tiny(out, "--stop-after-steps", "2", hooks=[Stateful()]) == EXIT_PREEMPTED
    assert run_tiny(out, "--resume", "auto") == 2
    err = capsys.readouterr().err.strip()
    assert (
        "holds the state of hooks [stateful-toy] that this run does not have: resume with the same hooks" in err
        and "\n" not in err
    )


def test_two_stateful_hooks_with_one_name_are_refused(tmp_path, capsys):
    assert run_tiny(tmp_path / "run", hooks=[Stateful(), Stateful()]) == 2
    assert "two stateful hooks are named 'stateful-toy'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_ema_is_evaluated_exported_and_resumed_exactly(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    assert run_tiny(full, hooks=[EMA(decay=0.8)]) == 0
    exported, trained = load_file(str(full / "model.safetensors")), load_file(str(full / "rank0.safetensors"))
    assert set(exported) == set(trained) and any(not torch.equal(exported[k], trained[k]) for k in trained)
    # the final evaluation ran on the averaged weights: evaluate the exported file by hand
    from acceltrain.vision import ImageClassification, synthetic_images

    model = tiny_recipe.build_net(batchnorm=False)
    model.load_state_dict(exported)
    _, (images, labels) = synthetic_images(40, 37, seed=0)
    eval_set = ImageClassification(images, labels, [str(i) for i in range(10)])
    with torch.no_grad():
        accuracy = (model(torch.stack([eval_set[i][0] for i in range(37)])).argmax(-1) == labels).float().mean().item()
    assert read_summary(full)["eval_accuracy"] == pytest.approx(accuracy)
    assert run_tiny(part, "--stop-after-steps", "5", hooks=[EMA(decay=0.8)]) == EXIT_PREEMPTED
    assert run_tiny(part, "--resume", "auto", hooks=[EMA(decay=0.8)]) == 0
    assert (part / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()
    assert (part / "rank0.safetensors").read_bytes() == (full / "rank0.safetensors").read_bytes()


@pytest.mark.parametrize("distributed_type,stage", [(DistributedType.FSDP, None), (DistributedType.DEEPSPEED, 3)])
def test_ema_refuses_sharded_weights_with_one_line(distributed_type, stage):
    accelerator = SimpleNamespace(
        distributed_type=distributed_type, state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=stage))
    )
    with pytest.raises(ConfigError, match="EMA needs every process to hold the full weights"):
        EMA().on_fit_start(SimpleNamespace(accelerator=accelerator))


@pytest.mark.parametrize("decay", [0.0, 1.0, -1])
def test_ema_refuses_a_decay_outside_zero_one(decay):
    with pytest.raises(ConfigError, match=f"EMA decay {decay!r} is invalid"):
        EMA(decay=decay)


def _fake_run(model, *, step, total_steps, time_fraction=0.0, distributed_type=DistributedType.NO):
    accelerator = SimpleNamespace(distributed_type=distributed_type, unwrap_model=lambda m: m)
    return SimpleNamespace(
        accelerator=accelerator,
        model=model,
        step=step,
        total_steps=total_steps,
        stop=None,
        last_eval_step=None,
        schedule_progress=SimpleNamespace(time_fraction=time_fraction),
    )


def test_lookahead_moves_the_average_by_the_ramped_decay_and_sets_the_weights_to_it():
    model = torch.nn.Linear(3, 2)
    lookahead = Lookahead(decay=0.9, every=4)
    run = _fake_run(model, step=0, total_steps=10)
    lookahead.on_fit_start(run)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    for step in (1, 2, 3):  # between updates the weights train freely
        run.step = step
        lookahead.on_step_end(run)
    with torch.no_grad():
        model.weight.add_(1.0)
    trained = model.weight.clone()
    run.step = 4  # an update at 40% of the run: decay 0.9**4 * 0.4**3
    lookahead.on_step_end(run)
    decay = 0.9**4 * 0.4**3
    assert torch.allclose(model.weight, decay * start["weight"] + (1 - decay) * trained)
    assert torch.equal(model.weight, lookahead.average["weight"]) and torch.equal(model.bias, start["bias"])
    with torch.no_grad():
        model.weight.add_(1.0)
    before, run.step, run.schedule_progress.time_fraction = model.weight.clone(), 7, 0.9  # a time budget 90% spent
    average = lookahead.average["weight"].clone()
    lookahead.on_train_end(run)  # an early finish off the update steps ends on the average too
    decay = 0.9**4 * 0.9**3
    assert torch.allclose(model.weight, decay * average + (1 - decay) * before)
    run.step = 10  # the last step updates whatever ``every`` says
    lookahead.on_step_end(run)
    assert lookahead.updated_step == 10


def test_lookahead_reevaluates_an_early_finish_already_evaluated_at_its_step():
    """A time budget ending on an epoch's last step, evaluated there before the final update: the final
    metrics must be the exported (averaged) weights', so it evaluates again."""
    model = torch.nn.Linear(3, 2)
    lookahead = Lookahead(decay=0.9, every=4)
    evaluated = []
    run = _fake_run(model, step=0, total_steps=100)
    run.evaluate = lambda: evaluated.append(run.step)
    lookahead.on_fit_start(run)
    run.step = run.last_eval_step = 6  # evaluated at this step (Run.evaluate records it)
    run.stop = SimpleNamespace(finish=True)
    lookahead.on_train_end(run)
    assert lookahead.updated_step == 6 and evaluated == [6]
    lookahead.on_train_end(run)  # updated at this step already: nothing more
    assert evaluated == [6]


@pytest.mark.slow
def test_lookahead_changes_training_and_resumes_exactly(tmp_path):
    plain, full, part = tmp_path / "plain", tmp_path / "full", tmp_path / "part"
    assert run_tiny(plain) == 0
    assert run_tiny(full, hooks=[Lookahead(decay=0.8, every=2)]) == 0
    assert (full / "model.safetensors").read_bytes() != (plain / "model.safetensors").read_bytes()
    assert (
        run_tiny(part, "--stop-after-steps", "4", hooks=[Lookahead(decay=0.8, every=2)]) == EXIT_PREEMPTED
    )  # an update step
    assert run_tiny(part, "--resume", "auto", hooks=[Lookahead(decay=0.8, every=2)]) == 0
    assert (part / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()
    assert (part / "rank0.safetensors").read_bytes() == (full / "rank0.safetensors").read_bytes()


def test_lookahead_refuses_deepspeed_with_one_line():
    run = _fake_run(torch.nn.Linear(1, 1), step=0, total_steps=1, distributed_type=DistributedType.DEEPSPEED)
    with pytest.raises(ConfigError, match="DeepSpeed's optimizer would overwrite them"):
        Lookahead().on_fit_start(run)


class OnlyLossAndValues:
    """A task written from the old README: train_loss and eval_values, nothing else."""

    def train_loss(self, model, batch):
        return ClassificationTask().train_loss(model, batch)

    def eval_values(self, model, batch):
        return ClassificationTask().eval_values(model, batch)


def test_a_task_without_primary_metric_fails_before_training_with_one_line(tmp_path, capsys):
    assert run_tiny(tmp_path / "run", task=OnlyLossAndValues()) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: task OnlyLossAndValues has no 'primary_metric': a task needs train_loss, eval_values, "
        "primary_metric, higher_is_better (see acceltrain.Task)"
    )
    assert not (tmp_path / "run").exists()


class LowerLossIsTheGoal(ClassificationTask):
    primary_metric = "loss"
    higher_is_better = False


def test_target_metric_reads_the_tasks_primary_metric(tmp_path):
    """Before: --target-accuracy read eval_accuracy whatever the task's primary metric, so this never stopped."""
    summary_args = [
        "--num-train",
        "512",
        "--batch-size",
        "32",
        "--max-steps",
        "200",
        "--lr",
        "0.5",
        "--eval-every",
        "4",
    ]
    assert run_tiny(tmp_path / "run", *summary_args, "--target-metric", "1.5", task=LowerLossIsTheGoal()) == 0
    summary = read_summary(tmp_path / "run")
    assert summary["eval_loss"] <= 1.5 and summary["steps"] < 200
    assert 0 < summary["time_to_target_seconds"] <= summary["wall_seconds"]


def test_target_accuracy_on_a_task_without_accuracy_is_a_one_line_error(tmp_path, capsys):
    assert run_tiny(tmp_path / "run", "--target-accuracy", "0.5", task=LowerLossIsTheGoal()) == 2
    err = capsys.readouterr().err.strip()
    assert (
        "--target-accuracy 0.5 needs a task whose primary metric is accuracy; LowerLossIsTheGoal's is 'loss': use "
        "--target-metric"
    ) in err


def test_the_final_checkpoint_records_the_position_inside_the_epoch(tmp_path):
    """Before: the end-of-run save always wrote batch_in_epoch=0 (then batches_in_epoch),
    so resuming it replayed the epoch's start."""
    out = tmp_path / "run"
    assert run_tiny(out, "--max-steps", "5", "--save-every-steps", "3") == 0
    state = json.loads((out / "checkpoints" / "step_00000005" / "trainer_state.json").read_text())
    assert (state["step"], state["epoch"], state["batch_in_epoch"]) == (5, 1, 3)
    state = json.loads((out / "checkpoints" / "step_00000003" / "trainer_state.json").read_text())
    assert (state["step"], state["epoch"], state["batch_in_epoch"]) == (3, 0, 9)


def test_save_every_minutes_checkpoints(tmp_path):
    out = tmp_path / "run"
    assert run_tiny(out, "--max-steps", "4", "--save-every-minutes", "0.000001") == 0
    assert [p.name for p in complete_checkpoints(out)] == [f"step_{s:08d}" for s in (1, 2, 3, 4)]


@pytest.mark.parametrize("flag", ["--stop-after-steps"])
def test_a_stop_on_the_last_step_finishes_the_run(tmp_path, flag):
    """Before: it printed "checkpoint saved" without saving, exited 75 and never wrote summary.json."""
    out = tmp_path / "run"
    assert run_tiny(out, "--max-steps", "6", flag, "6") == 0
    assert read_summary(out)["steps"] == 6
    assert [p.name for p in complete_checkpoints(out)] == ["step_00000006"]


def test_the_readme_hook_example_runs_as_written(tmp_path):
    import re

    from conftest import REPO

    readme = (REPO / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "class WeightNorm" in b]
    assert len(block.strip().splitlines()) <= 25
    namespace: dict = {}
    exec(block, namespace)
    assert run_tiny(tmp_path / "run", "--max-steps", "4", hooks=[namespace["WeightNorm"](2)]) == 0
    assert [row["step"] for row in read_events(tmp_path / "run") if "weight_norm" in row] == [2, 4]


class SlowFitEnd(Hook):
    """on_fit_end takes 1000 s on the throughput meter's clock (acceltrain.runtime.metrics reads time.perf_counter),
    without waiting: longer than any run here, however slow the machine."""

    def __init__(self, monkeypatch):
        self.later = 0.0
        monkeypatch.setattr(
            "acceltrain.runtime.metrics.time", SimpleNamespace(perf_counter=lambda: time.perf_counter() + self.later)
        )

    def on_fit_end(self, run, summary):
        self.later += 1000.0


def test_throughput_never_counts_time_after_training(tmp_path, monkeypatch):
    """Before: after an early finish with a final checkpoint, the save's pause resumed the throughput timer,
    so the work after training (here a hook's 1000 s in on_fit_end) was counted as training time."""
    args = [
        "--num-train",
        "512",
        "--batch-size",
        "32",
        "--max-steps",
        "200",
        "--lr",
        "0.5",
        "--eval-every",
        "4",
        "--target-accuracy",
        "0.5",
        "--save-every-steps",
        "100",
        "--timing-warmup-steps",
        "1",
    ]
    assert run_tiny(tmp_path / "run", *args, hooks=[SlowFitEnd(monkeypatch)]) == 0
    summary = read_summary(tmp_path / "run")
    assert summary["steps"] < 200
    timed_seconds = summary["ms_per_step"] * summary["timed_steps"] / 1000
    assert timed_seconds < summary["wall_seconds"], (timed_seconds, summary["wall_seconds"])
