"""acceltrain predict RUN_FOLDER FILE --output predictions.csv: a fine-tuned model's predictions for the rows of a
file. A text classifier's run folder (recipes/text_classification.py) gives each row's text, its predicted_label and
class probabilities, and, where FILE has the run's label column, the true label and the task's metrics on the
labelled rows (printed and written to <output>.metrics.json); a language model's (recipes/causal_lm.py) a generated
response to each prompt (greedy, at most --max-new-tokens). Every weight, a LoRA adapter folder (loaded onto its base
model) or the merged model; rows in csv, json, jsonl or parquet, tokenised as the run tokenised its own (its
--max-length, its columns). Rows are sorted by length into batches padded per batch; the output keeps the input's
order. Under `accelerate launch` the batches are split between the processes and gathered once: every row is
predicted once, whatever the process count. --output is never FILE or a file in RUN_FOLDER, and an existing file only
with --overwrite.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

from acceltrain.config.options import (
    ConfigError,
    Options,
    file_kind,
    first_line,
    option,
    parse_json,
    read_small_file,
    require,
    shorten,
)

__all__ = ["Predictions", "PredictOptions", "main", "predict"]

TASKS = {"AutoModelForSequenceClassification": "text-classification", "AutoModelForCausalLM": "text-generation"}
ADAPTER_TASKS = {"SEQ_CLS": "text-classification", "CAUSAL_LM": "text-generation"}  # peft's task types
RECIPES = "text classification (recipes/text_classification.py) or language models (recipes/causal_lm.py)"


@dataclasses.dataclass
class PredictOptions(Options):
    """What ``acceltrain predict`` reads, writes, and how."""

    run_folder: str | None = option(
        None, "a finished run folder of the text-classification or causal-LM recipe", positional=True
    )
    file: str | None = option(None, "the rows to predict: a .csv, .json, .jsonl or .parquet file", positional=True)
    output: str | None = option(
        "predictions.csv",
        "where the predictions go, a row per input row in the input's order: a .csv, .json, .jsonl or .parquet file "
        "(a labelled file's metrics beside it, in <name>.metrics.json)",
    )
    overwrite: bool = option(
        False, "replace an --output (or its .metrics.json) that exists; never FILE itself or a file in RUN_FOLDER"
    )
    text_column: str | None = option(
        None,
        "the column to read (default: the run's --text-column; for a language model its "
        "--messages-column when the file has one, else its --prompt-column)",
    )
    batch_size: int = option(32, "rows per batch on each process, sorted by length and padded per batch")
    max_new_tokens: int = option(64, "a language model: tokens generated per prompt at most (greedy decoding)")
    progress: bool | None = option(
        None, "a progress bar: --progress always, --no-progress never (default: when stderr is a terminal)"
    )

    def validate(self) -> None:
        super().validate()
        from acceltrain.text.tables import TABLE_KINDS

        require(self.batch_size >= 1, "batch_size", self.batch_size, "an integer >= 1")
        require(self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, "an integer >= 1")
        if self.output is not None:
            suffix = Path(self.output).suffix.lower()
            require(suffix in TABLE_KINDS, "output", self.output, f"a file named {', '.join(TABLE_KINDS)}")


def _metrics_path(output: str | Path) -> Path:
    """Where the metrics of a labelled file go: beside the predictions, ``<name>.metrics.json``."""
    return Path(output).expanduser().with_suffix(".metrics.json")


def _check_output(path: Path, options: PredictOptions) -> None:
    """``path`` (the predictions, or their metrics) is a file predict may replace: not a folder or a device, not
    FILE or a file in RUN_FOLDER by any path (a link included: the input would be lost, the run folder no longer
    load), not an existing file unless --overwrite, and in a folder this process can write."""
    shown = f"--output {shorten(options.output, 200)}"
    subject = shown if path == Path(options.output).expanduser() else f"{shown}: its metrics file {str(path)!r}"
    if not path.parent.is_dir():
        raise ConfigError(f"{shown}: there is no folder {str(path.parent)!r} to write it in")
    exists = path.exists()
    kind = file_kind(path.stat().st_mode) if exists else None
    if kind:
        raise ConfigError(f"{subject} is {kind}, not a file: give the name of a file to write")
    file = Path(options.file).expanduser()
    if exists and file.exists() and os.path.samefile(path, file):
        raise ConfigError(
            f"{subject} is FILE {options.file!r}, the rows to predict: predict never replaces its input; give another "
            "--output"
        )
    if path.resolve().is_relative_to(Path(options.run_folder).expanduser().resolve()):
        raise ConfigError(
            f"{subject} is inside RUN_FOLDER {options.run_folder!r}: predict writes nothing there (its files load the "
            "model and record the run); give another --output"
        )
    if exists and not options.overwrite:
        raise ConfigError(f"{subject} exists: pass --overwrite to replace it")
    try:
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as err:
        raise ConfigError(f"{subject} cannot be written: {first_line(err)}") from None


class Predictions(list):
    """What :func:`predict` returns: a dict per row of the file, in its order, as written to ``output``;
    ``metrics``: for a classifier and a file with the run's label column, the task's metrics on its labelled rows
    (as ``<output>.metrics.json`` holds them), else None."""

    def __init__(self, rows: list[dict], metrics: dict | None = None):
        super().__init__(rows)
        self.metrics = metrics


def predict(
    run_folder: str | Path,
    file: str | Path,
    *,
    output: str | Path | None = None,
    overwrite: bool = False,
    text_column: str | None = None,
    batch_size: int = 32,
    max_new_tokens: int = 64,
    progress: bool | None = False,
) -> Predictions:
    """The predictions of ``run_folder``'s model for the rows of ``file``, one dict per row in its order, on every
    process: for a classifier the row's text (and text pair) column, its true label when ``file`` has the run's label
    column, ``predicted_label`` and ``probability_<label>`` per class, with the task's metrics on the labelled rows
    as ``.metrics`` (see :class:`Predictions`); for a language model ``{"response": ...}``. Also written to ``output``
    when given (the metrics to ``<output stem>.metrics.json``); an existing file is replaced only with
    ``overwrite``, never ``file`` or a file of ``run_folder``. Bad input is one :class:`~acceltrain.ConfigError`,
    before anything is written. Under ``accelerate launch`` each process predicts its share of the batches."""
    options = PredictOptions(
        run_folder=str(run_folder),
        file=str(file),
        output=None if output is None else str(output),
        overwrite=overwrite,
        text_column=text_column,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        progress=progress,
    )
    options.validate()
    return _predict(options)


def _predict(options: PredictOptions) -> Predictions:
    from accelerate.utils import gather_object
    from tqdm.auto import tqdm

    from acceltrain.hf.hub import load_model
    from acceltrain.runtime.distributed import process_state
    from acceltrain.runtime.logs import show_progress
    from acceltrain.text import load_table, pretrained_tokenizer
    from acceltrain.text.predictors import Classifier, Generator

    state = process_state()
    folder = Path(options.run_folder).expanduser()
    task, settings = _run_folder(folder)
    if options.output is not None:
        _check_output(Path(options.output).expanduser(), options)
    rows = load_table(options.file, "FILE")
    tokenizer = pretrained_tokenizer(None, str(folder), flag="RUN_FOLDER")
    model = load_model(folder).to(state.device)
    predictor = (Classifier if task == "text-classification" else Generator)(model, tokenizer, settings, options)
    examples = predictor.encode(rows, options.text_column, f"FILE {options.file!r}", folder)
    if options.output is not None and predictor.scores:
        _check_output(_metrics_path(options.output), options)
    order = sorted(range(len(examples)), key=lambda index: len(examples[index]["input_ids"]), reverse=True)  # stable
    batches = [order[start : start + options.batch_size] for start in range(0, len(order), options.batch_size)]
    results = []
    with state.split_between_processes(batches) as own:  # contiguous shares, no padding: each batch on one process
        bar = tqdm(
            own,
            desc="predict",
            unit="batch",
            dynamic_ncols=True,
            disable=not (show_progress(options.progress) and state.is_main_process),
        )
        for batch in bar:
            results += zip(batch, predictor(model, [examples[index] for index in batch]), strict=True)
    gathered = gather_object(results) if state.num_processes > 1 else results
    predictions = [prediction for _, prediction in sorted(gathered, key=lambda pair: pair[0])]
    if len(predictions) != len(rows):  # every batch once: split_between_processes neither drops nor repeats one
        raise RuntimeError(f"{len(predictions)} predictions for {len(rows)} rows")
    written, metrics = predictor.finish(predictions)
    if metrics is not None:
        where = {"file": options.file, "run_folder": options.run_folder}  # by their absolute paths: a record
        metrics = {key: str(Path(path).expanduser().resolve()) for key, path in where.items()} | metrics
    if options.output is not None and state.is_main_process:
        _write(written, Path(options.output).expanduser())
        if metrics is not None:
            with _replacing(_metrics_path(options.output)) as partial:
                partial.write_text(json.dumps(metrics, indent=2) + "\n")
    return Predictions(written, metrics)


def _run_folder(folder: Path) -> tuple[str, dict]:
    """(the task of the run folder's model, its train_config.yaml): a folder that is no finished run of the fine-tuning
    recipes, or of another task, is one line."""
    import yaml

    from acceltrain.hf.auto_classes import auto_class
    from acceltrain.runtime.run_folder import ADAPTER_CONFIG_FILE, CONFIG_FILE, TRAIN_CONFIG_FILE

    shown = f"RUN_FOLDER {str(folder)!r}"
    if not folder.is_dir():
        raise ConfigError(f"{shown} is not a folder: give the output folder of a fine-tuning run")
    adapter = (folder / ADAPTER_CONFIG_FILE).is_file()
    if not (folder / TRAIN_CONFIG_FILE).is_file() or not (adapter or (folder / CONFIG_FILE).is_file()):
        raise ConfigError(
            f"{shown} is not the folder of a finished run (no {TRAIN_CONFIG_FILE} beside a {CONFIG_FILE} or "
            f"{ADAPTER_CONFIG_FILE}): give the output folder of a fine-tuning run of {RECIPES}"
        )
    try:
        settings = yaml.safe_load(read_small_file(str(folder / TRAIN_CONFIG_FILE), "the run's"))
        config = parse_json(
            read_small_file(str(folder / (ADAPTER_CONFIG_FILE if adapter else CONFIG_FILE)), "the run's")
        )
    except (ValueError, yaml.YAMLError) as err:
        raise ConfigError(
            f"{shown}: its {TRAIN_CONFIG_FILE} or model config is unreadable ({str(err).splitlines()[0]})"
        ) from None
    if not isinstance(settings, dict) or not isinstance(config, dict):
        raise ConfigError(f"{shown}: its {TRAIN_CONFIG_FILE} or model config is not a mapping, as a run writes them")
    if adapter:
        task, kind = (
            ADAPTER_TASKS.get(config.get("task_type")),
            f"an adapter of peft task type {config.get('task_type')!r}",
        )
    else:
        head = auto_class(_Attributes(config)) if "model_type" in config else None
        task = TASKS.get(head[0] if head else None)
        kind = (
            f"a model that loads with {head[0]}"
            if head
            else f"a model of {shorten(config.get('builder', 'no known class'))}"
        )
    if task is None:
        raise ConfigError(f"{shown} holds {kind}: predict reads the run folders of {RECIPES}")
    return task, settings


class _Attributes:
    """A JSON config read as attributes, as :func:`acceltrain.hf.auto_classes.auto_class` reads a model config."""

    def __init__(self, values: dict):
        self.__dict__.update(values)


def _write(predictions: list[dict], path: Path) -> None:
    """The predictions as a table of the suffix's kind."""
    import datasets

    table = datasets.Dataset.from_list(predictions)
    kind = path.suffix.lower()
    with _replacing(path) as partial:
        if kind == ".csv":
            table.to_csv(partial, index=False)
        elif kind == ".parquet":
            table.to_parquet(partial)
        else:
            table.to_json(partial, lines=kind == ".jsonl", force_ascii=False)


@contextlib.contextmanager
def _replacing(path: Path):
    """A temporary file beside ``path`` to write, renamed to ``path`` at the end: written whole or not at all, and
    nothing left behind when writing fails (a full disk: one line)."""
    partial = path.with_name(f".{path.name}.partial")
    try:
        yield partial
        os.replace(partial, path)
    except OSError as err:
        raise ConfigError(f"--output {str(path)!r} could not be written: {first_line(err)}") from None
    finally:
        partial.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    """``acceltrain predict``: exit 0, or 2 with one line on bad input."""
    from acceltrain.config.parser import parse_config
    from acceltrain.runtime.logs import set_log_level
    from acceltrain.runtime.preemption import EXIT_BAD_INPUT, report_error

    try:
        options = parse_config(
            PredictOptions, sys.argv[1:] if argv is None else argv, description=__doc__, prog="acceltrain predict"
        )
        set_log_level("info")
        from acceltrain.text import show_progress_bars

        show_progress_bars(False)  # the libraries' (reading the file, loading weights); predict draws its own
        predictions = _predict(options)
    except ConfigError as err:
        report_error(str(err))
        return EXIT_BAD_INPUT
    if os.environ.get("RANK", "0") == "0":
        print(f"wrote {len(predictions)} predictions to {options.output}")
        metrics = predictions.metrics
        if metrics is not None:
            rows = "" if metrics["labelled_rows"] == metrics["rows"] else f" of {metrics['rows']:,}"
            print(
                f"accuracy {metrics['accuracy']:.4f}, macro-F1 {metrics['macro_f1']:.4f}, loss {metrics['loss']:.4f} "
                f"({metrics['labelled_rows']:,} labelled rows{rows}): {_metrics_path(options.output)}"
            )
    return 0
