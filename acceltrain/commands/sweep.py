"""acceltrain sweep: a hyperparameter search on Optuna whose trials are ordinary runs, and which survives preemption.

  acceltrain sweep --study-dir DIR --trials N --param NAME=SPEC [--param ...] RECIPE [RECIPE ARGS...]

Each trial is a run folder DIR/trial_0000, trial_0001, ... launched as any run is (one process, or `accelerate
launch --config_file CONFIG`), with its parameters among its flags (so in its train_config.yaml) and its W&B run in
the study's group. Each evaluation is reported to the study; a trial the pruner gives up on finishes at that step
(stop_reason "pruned"). SIGTERM, SIGUSR1 or Ctrl-C stop the running trial at its step boundary with a checkpoint and
the sweep exits 75, marking nothing failed; the same command again resumes that trial from its checkpoint and goes on
until the study has N trials. A trial that fails (bad input for its parameters, a divergence) is recorded failed with
its one line and the sweep goes on; bad input every trial would meet stops the sweep at the first, writing nothing.

SPEC: loguniform:LOW:HIGH, uniform:LOW:HIGH, int:LOW:HIGH (both ends included) or choice:A,B,C. NAME is any flag of
the recipe (its --help lists them), with or without the dashes: --param lr=loguniform:1e-3:1 --param
optimizer=choice:sgd,adamw.

Results, rewritten after every trial: DIR/sweep.json (best parameters, value and folder; counts by state),
DIR/trials.csv, DIR/history.png and DIR/importance.png. `acceltrain sweep --study-dir DIR --show` prints the table.
Several workers (a SLURM job array) share one study through --storage and one --study-dir on a shared file system."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from acceltrain.config.options import ConfigError
from acceltrain.runtime.preemption import EXIT_BAD_INPUT, EXIT_PREEMPTED

SAMPLERS = ("tpe", "random", "grid")


def build_parser() -> argparse.ArgumentParser:
    from acceltrain.config.parser import command_parser
    from acceltrain.hooks.pruning import PRUNERS

    parser = command_parser("acceltrain sweep", __doc__)
    add = parser.add_argument
    add("--study-dir", help="the study's folder: trial_NNNN run folders, results, the journal storage; required")
    add("--trials", type=int, help="trials in the whole study, over every run of the command and every worker")
    add("--param", action="append", default=[], metavar="NAME=SPEC", help="a recipe flag to search; repeat per flag")
    add("--metric", help="the eval metric to optimise, as the run logs it (default: the task's primary metric)")
    add("--direction", choices=("maximize", "minimize"), help="default: the task's own for its primary metric")
    add("--pruner", choices=PRUNERS, default="median", help="stop poor trials early (median after 5 trials; default)")
    add("--sampler", choices=SAMPLERS, default="tpe", help="tpe (default), random, or grid (int and choice only)")
    add("--seed", type=int, default=0, help="the sampler's seed: the same study asks the same parameters (default 0)")
    add("--storage", help="an Optuna RDB URL workers share, e.g. sqlite:///shared/study.db (default: DIR's journal)")
    add("--study-name", help="the study's name in --storage (default: the study folder's name)")
    add("--launch-config", help="an accelerate config: each trial runs as accelerate launch --config_file CONFIG")
    add("--show", action="store_true", help="print the study's table and best trial; run nothing")
    add("recipe", nargs="?", help="the recipe: a script (recipes/resnet_cifar.py) or a module")
    add("recipe_args", nargs=argparse.REMAINDER, help="the recipe's own flags, the same for every trial")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.study_dir is None:
            raise ConfigError("--study-dir is required: the folder of the study's trials and results")
        study_dir = Path(args.study_dir)
        if args.show:
            return show(args, study_dir)
        return Sweep(args, study_dir).run()
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ImportError as err:
        if "optuna" not in str(err):
            raise
        print("error: acceltrain sweep needs Optuna: pip install 'acceltrain[sweep]'", file=sys.stderr)
        return EXIT_BAD_INPUT


def show(args, study_dir: Path) -> int:
    from acceltrain.commands import sweep_study as studies

    spec = studies.storage_spec(study_dir, args.storage)
    if args.storage is None and not (study_dir / studies.JOURNAL_FILE).is_file():
        raise ConfigError(
            f"--study-dir {str(study_dir)!r} holds no study journal: give the --storage its sweep used, or the "
            "study's folder"
        )
    study = studies.load_study(spec, args.study_name or study_dir.resolve().name)
    if study is None or studies.IDENTITY_KEY not in study.user_attrs:
        raise ConfigError(f"--storage {args.storage!r} holds no acceltrain sweep named after {str(study_dir)!r}")
    identity = study.user_attrs[studies.IDENTITY_KEY]
    studies.print_table(study, identity, studies.results(study, study_dir, identity, identity["trials"], spec))
    return 0


class Sweep:
    """One run of the command: check everything knowable before any trial, then take trials (a preempted one
    first, else a new one while the study has fewer than N) until none is left or a signal stops the sweep."""

    def __init__(self, args, study_dir: Path):
        self.args, self.study_dir = args, study_dir
        self.found = set(os.listdir(study_dir)) if study_dir.is_dir() else None  # to leave it as found on bad input
        self.created = False  # this command began the study (after its probe)
        self.loaded = False  # this command found the study begun

    def check(self) -> None:
        from acceltrain.commands.recipe_loading import module_exists, recipe_config_class
        from acceltrain.commands.sweep_space import check_with_recipe, parse_params

        args = self.args
        if args.trials is None:
            raise ConfigError("--trials is required: how many trials the study runs in all")
        if args.trials < 1:
            raise ConfigError(f"--trials {args.trials}: it must be an integer >= 1 (the study's trials in all)")
        if not args.param:
            raise ConfigError("give at least one --param NAME=SPEC: the recipe flags to search")
        if args.recipe is None:
            raise ConfigError("give the recipe after the sweep's flags: acceltrain sweep ... recipes/my_recipe.py")
        if args.recipe.startswith("-"):
            raise ConfigError(f"unrecognized arguments: {args.recipe} (acceltrain sweep --help lists its flags)")
        if not (Path(args.recipe).is_file() or module_exists(args.recipe)):
            raise ConfigError(f"recipe {args.recipe!r} is neither a file nor an importable module")
        if args.launch_config is not None and not Path(args.launch_config).is_file():
            raise ConfigError(f"--launch-config {args.launch_config!r} is not a file (an accelerate config YAML)")
        if self.study_dir.exists() and not self.study_dir.is_dir():
            raise ConfigError(f"--study-dir {str(self.study_dir)!r} exists and is not a directory")
        self._check_owned()
        self.config_class = recipe_config_class(args.recipe, "recipe")
        self.params = parse_params(args.param, self.config_class, args.recipe, args.recipe_args)
        if args.sampler == "grid":
            self._check_grid()
        check_with_recipe(self.params, self.config_class, args.recipe_args)

    def _check_owned(self) -> None:
        """The study folder is new, empty or a study's (its lock, journal or results): a folder of the user's is not
        the sweep's to write trials into."""
        from acceltrain.commands import sweep_study as studies

        if not self.study_dir.is_dir():
            return
        names = sorted(os.listdir(self.study_dir))
        markers = {studies.LOCK_FILE, studies.JOURNAL_FILE, studies.SWEEP_FILE, studies.CLAIMS_DIR}
        if names and not markers & set(names):
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            raise ConfigError(
                f"--study-dir {str(self.study_dir)!r} holds files that are not a study's ({shown}): give a new or "
                "empty folder, or the folder of a study to continue"
            )

    def _check_grid(self) -> None:
        import math

        grid = [p for p in self.params if p.kind in ("loguniform", "uniform")]
        if grid:
            raise ConfigError(f"--sampler grid needs int or choice parameters: --param {grid[0].name}={grid[0].spec}")
        points = math.prod(len(p.choices) if p.kind == "choice" else p.high - p.low + 1 for p in self.params)
        if self.args.trials > points:
            raise ConfigError(f"--trials {self.args.trials} is more than the grid's {points} points: at most {points}")

    def run(self) -> int:
        from acceltrain.commands import sweep_study as studies
        from acceltrain.commands.sweep_trial import Stopper

        self.check()
        args = self.args
        self.spec = studies.storage_spec(self.study_dir, args.storage)
        if args.storage is not None:
            from acceltrain.hooks.pruning import check_reachable

            check_reachable(args.storage)  # an unreachable URL: one line, nothing written
        self.stopper = Stopper().install()
        try:
            return self._run()
        finally:
            self.stopper.restore()

    def _run(self) -> int:
        from acceltrain.commands import sweep_study as studies

        self.study_dir.mkdir(parents=True, exist_ok=True)
        self.lock = self.study_dir / studies.LOCK_FILE
        self.name = self.args.study_name or self.study_dir.resolve().name
        try:
            with studies.locked(self.lock):
                self.study, self.identity = self._open_study()
        except BaseException:
            if not self.loaded:  # an existing study's folder is another worker's too: left alone
                self._leave_as_found()
            raise
        if self.study is None:  # stopped while probing
            self._leave_as_found()
            return EXIT_PREEMPTED
        return self._loop()

    def _identity(self) -> dict:
        recipe = str(Path(self.args.recipe).resolve()) if Path(self.args.recipe).is_file() else self.args.recipe
        return {
            "format": 1,
            "recipe": recipe,
            "recipe_args": list(self.args.recipe_args),
            "params": {p.name: p.spec for p in self.params},
            "trials": self.args.trials,
        }

    def _open_study(self):
        """The study of this folder, checked to be this command's; a new one after a probe of the recipe."""
        from acceltrain.commands import sweep_study as studies
        from acceltrain.hooks.pruning import shown_url

        identity = self._identity()
        given = {"metric": self.args.metric, "direction": self.args.direction}
        study = studies.load_study(self.spec, self.name)
        if study is not None:
            self.loaded = True
            return study, {**studies.check_identity(study, identity, self.study_dir, given), "trials": self.args.trials}
        if any(self.study_dir.glob("trial_*")):
            raise ConfigError(
                f"--study-dir {str(self.study_dir)!r} holds trial folders of a study that is not in "
                f"{shown_url(self.spec)!r}: give the --storage (and --study-name) its sweep used, or another "
                "--study-dir"
            )
        found = self._probe()
        if found is None:
            return None, None
        identity.update(found)
        self.created = True
        return studies.create_study(self.spec, self.name, identity), identity

    def _probe(self) -> dict | None:
        """The recipe launched once as a trial would be, stopping before its first step: the task's primary metric
        and the eval metrics it logs, and any bad input common to every trial, known before the first trial."""
        import json
        import tempfile

        from acceltrain.commands.recipe_loading import command
        from acceltrain.commands.sweep_space import trial_flags
        from acceltrain.commands.sweep_trial import child_env, last_error, launch

        with tempfile.TemporaryDirectory() as scratch:
            answer = Path(scratch) / "probe.json"
            values = {p.name: p.sample_value() for p in self.params}
            argv = [
                *self.args.recipe_args,
                *trial_flags(self.params, values, self.config_class),
                *["--output-dir", str(Path(scratch) / "run"), "--report-to", "none"],
            ]
            print(f"sweep: checking recipe {self.args.recipe} once before the first trial", flush=True)
            ended, stderr = launch(
                command(self.args.recipe, argv, self.args.launch_config),
                child_env({"probe": str(answer)}),
                self.stopper,
                echo=False,
            )
            if self.stopper.received is not None:
                return None
            if not answer.is_file():
                line = (last_error(stderr) or f"error: the recipe exited with code {ended.returncode}").removeprefix(
                    "error: "
                )
                raise ConfigError(f"{line} (every trial would meet it: nothing was run)")
            found = json.loads(answer.read_text())
        return self._metric(found)

    def _metric(self, found: dict) -> dict:
        metric, direction = self.args.metric or found["primary_metric"], self.args.direction
        logged = found["eval_metrics"]
        if not logged:
            raise ConfigError(
                f"recipe {self.args.recipe} evaluates nothing (no eval set): a sweep compares its trials by an "
                "eval metric"
            )
        if metric not in logged:
            raise ConfigError(f"--metric {metric}: the task does not log it; it logs {', '.join(logged)}")
        if direction is None:
            if metric != found["primary_metric"]:
                raise ConfigError(
                    f"--metric {metric} is not the task's primary metric ({found['primary_metric']}): say which way "
                    "is better with --direction maximize or --direction minimize"
                )
            direction = "maximize" if found["higher_is_better"] else "minimize"
        return {"metric": metric, "direction": direction}

    def _leave_as_found(self) -> None:
        """Bad input found before any trial ran: what this command added to the study folder is removed."""
        from acceltrain.runtime.run_folder import remove_added

        remove_added(self.study_dir, self.found)

    def _loop(self) -> int:
        from acceltrain.commands import sweep_study as studies

        code = 0
        while self.stopper.received is None:
            with studies.locked(self.lock):
                taken = self._take()
            if taken is None:
                break
            code = self._run_trial(*taken)
            if code == EXIT_BAD_INPUT:
                return code
            if code is not None:
                break
            code = 0
        if self.stopper.received is not None:
            code = code or EXIT_PREEMPTED
        with studies.locked(self.lock):
            result = studies.write_results(self.study, self.study_dir, self.identity, self.args.trials, self.spec)
            studies.draw_plots(self.study, self.study_dir, self.identity)
        if code == EXIT_PREEMPTED and result["finished"]:
            code = 0  # the signal came as the last trial ended: nothing is left to resume
        studies.print_table(self.study, self.identity, result)
        if code == EXIT_PREEMPTED:
            print("sweep: stopped to be resumed; run the same command again to continue", file=sys.stderr)
        return code

    def _take(self):
        """A running trial no live worker holds (preempted: resumed from its checkpoint), else a new trial while the
        study has fewer than N; None when there is nothing left for this worker. Called under the study's lock."""
        from acceltrain.commands import sweep_study as studies

        trials = studies.counted(self.study.trials)
        for trial in trials:
            if trial.state.name == "RUNNING":
                claim = studies.Claim(self.study_dir, trial.number)
                if claim.take():
                    return trial.number, trial._trial_id, dict(trial.params), claim
        if len(trials) >= self.args.trials:
            return None
        self.study.sampler = studies.sampler(self.args.sampler, self.params, self.args.seed, len(self.study.trials))
        trial = self.study.ask({p.name: p.distribution() for p in self.params})
        claim = studies.Claim(self.study_dir, trial.number)
        claim.take()
        return trial.number, trial._trial_id, dict(trial.params), claim

    def _run_trial(self, number: int, trial_id: int, values: dict, claim) -> int | None:
        """Launch one trial and tell the study how it ended. Returns the sweep's exit code when it must stop."""
        from acceltrain.commands import sweep_study as studies
        from acceltrain.commands.recipe_loading import command
        from acceltrain.commands.sweep_space import trial_flags
        from acceltrain.commands.sweep_trial import child_env, has_checkpoint, launch, names_a_swept_flag
        from acceltrain.commands.sweep_trial import outcome as trial_outcome

        folder = studies.trial_folder(self.study_dir, number)
        try:
            shown = " ".join(f"{name}={studies._shown_value(value)}" for name, value in values.items())
            resumed = " (resumed from its checkpoint)" if has_checkpoint(folder) else ""
            print(f"sweep: trial {number}{resumed}: {shown}", flush=True)
            argv = [
                *self.args.recipe_args,
                *trial_flags(self.params, values, self.config_class),
                *["--output-dir", str(folder), "--resume", "auto"],
            ]
            if not any(arg.startswith("--wandb-group") for arg in self.args.recipe_args):
                argv += ["--wandb-group", self.name]
            spec = {
                "storage": self.spec,
                "study": self.name,
                "trial_id": trial_id,
                "number": number,
                "metric": self.identity["metric"],
                "pruner": self.args.pruner,
            }
            if self.stopper.received is not None:
                return EXIT_PREEMPTED
            ended, _ = launch(command(self.args.recipe, argv, self.args.launch_config), child_env(spec), self.stopper)
            if ended.to_resume:
                return EXIT_PREEMPTED
            state, value, line = trial_outcome(ended, studies.read_trial_summary(folder), self.identity["metric"])
            with studies.locked(self.lock):
                common = (
                    state == "failed"
                    and ended.bad_input
                    and not names_a_swept_flag(line, [p.flag for p in self.params])
                    and not any(t.state.name in ("COMPLETE", "PRUNED") for t in self.study.trials)
                )
                alone = common and self.created and len(self.study.trials) == 1
                if alone:  # nothing of the study is worth keeping: it goes, as bad input leaves nothing behind
                    import optuna

                    optuna.delete_study(study_name=self.name, storage=self.study._storage)
                else:
                    studies.tell(self.study, number, trial_id, (state, value, line), common)
                    studies.write_results(self.study, self.study_dir, self.identity, self.args.trials, self.spec)
            if common:
                if alone:
                    self._leave_as_found()
                print(f"error: {line} (every trial would meet it: the sweep stops)", file=sys.stderr)
                return EXIT_BAD_INPUT
            return None
        finally:
            claim.release()
