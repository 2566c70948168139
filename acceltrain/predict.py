"""acceltrain predict RUN_FOLDER FILE --output predictions.csv: a fine-tuned model's predictions for the rows of a
file. A text classifier's run folder (recipes/text_classification.py) gives each row's label and class probabilities;
a language model's (recipes/causal_lm.py) a generated response to each prompt (greedy, at most --max-new-tokens). Every
weight, a LoRA adapter folder (loaded onto its base model) or the merged model; rows in csv, json, jsonl or parquet,
tokenised as the run tokenised its own (its --max-length, its columns). Rows are sorted by length into batches padded
per batch; the output keeps the input's order. Under `accelerate launch` the batches are split between the
processes and gathered once: every row is predicted once, whatever the process count.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from .options import ConfigError, Options, option, parse_json, read_small_file, require, shorten

__all__ = ["PredictOptions", "main", "predict"]

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
        "where the predictions go, a row per input row in the input's order: a .csv, .json, .jsonl or .parquet file",
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
        from .text.tables import TABLE_KINDS

        require(self.batch_size >= 1, "batch_size", self.batch_size, "an integer >= 1")
        require(self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, "an integer >= 1")
        if self.output is not None:
            output = Path(self.output).expanduser()
            require(
                output.suffix.lower() in TABLE_KINDS, "output", self.output, f"a file named {', '.join(TABLE_KINDS)}"
            )
            if not output.parent.is_dir():
                raise ConfigError(
                    f"--output {shorten(self.output)}: there is no folder {str(output.parent)!r} to write it in"
                )


def predict(
    run_folder: str | Path,
    file: str | Path,
    *,
    output: str | Path | None = None,
    text_column: str | None = None,
    batch_size: int = 32,
    max_new_tokens: int = 64,
    progress: bool | None = False,
) -> list[dict]:
    """The predictions of ``run_folder``'s model for the rows of ``file``, one dict per row in its order, on every
    process (``{"label": ..., "probability_<label>": ...}`` for a classifier, ``{"response": ...}`` for a language
    model), also written to ``output`` when given. Bad input is one :class:`~acceltrain.ConfigError`, before anything
    is written. Under ``accelerate launch`` each process predicts its share of the batches."""
    options = PredictOptions(
        run_folder=str(run_folder),
        file=str(file),
        output=None if output is None else str(output),
        text_column=text_column,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        progress=progress,
    )
    options.validate()
    return _predict(options)


def _predict(options: PredictOptions) -> list[dict]:
    from accelerate.utils import gather_object
    from tqdm.auto import tqdm

    from .distributed import process_state
    from .hub import load_model
    from .logs import show_progress
    from .text import load_table, pretrained_tokenizer

    state = process_state()
    folder = Path(options.run_folder).expanduser()
    task, settings = _run_folder(folder)
    rows = load_table(options.file, "FILE")
    tokenizer = pretrained_tokenizer(None, str(folder), flag="RUN_FOLDER")
    model = load_model(folder).to(state.device)
    predictor = (_Classifier if task == "text-classification" else _Generator)(model, tokenizer, settings, options)
    examples = predictor.encode(rows, options.text_column, f"FILE {options.file!r}", folder)
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
    if options.output is not None and state.is_main_process:
        _write(predictions, Path(options.output).expanduser())
    return predictions


def _run_folder(folder: Path) -> tuple[str, dict]:
    """(the task of the run folder's model, its train_config.yaml): a folder that is no finished run of the fine-tuning
    recipes, or of another task, is one line."""
    import yaml

    from .auto_classes import auto_class
    from .run_folder import ADAPTER_CONFIG_FILE, CONFIG_FILE, TRAIN_CONFIG_FILE

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
    """A JSON config read as attributes, as :func:`acceltrain.auto_classes.auto_class` reads a Transformers config."""

    def __init__(self, values: dict):
        self.__dict__.update(values)


def _checked_column(rows, column: str, flag: str, where: str, folder: Path, task: str) -> None:
    from .text import check_columns

    try:
        check_columns(rows, where, **{flag: column})
    except ConfigError as err:
        reads = "texts to classify" if task == "text-classification" else "prompts to respond to"
        raise ConfigError(
            f"{err} ({str(folder)!r} is a {task} run folder: it reads {reads}; --text-column names the column)"
        ) from None


class _Classifier:
    """Rows -> each one's label and class probabilities, tokenised as the run tokenised its own (columns,
    --max-length)."""

    def __init__(self, model, tokenizer, settings: dict, options: PredictOptions):
        from .text import classification_batches

        self.tokenizer, self.settings, self.collate = tokenizer, settings, classification_batches(tokenizer)
        self.labels = [model.config.id2label[index] for index in range(model.config.num_labels)]

    def encode(self, rows, column: str | None, where: str, folder: Path) -> list[dict]:
        from .text import check_texts

        text, pair = column or self.settings.get("text_column", "text"), self.settings.get("text_pair_column")
        _checked_column(rows, text, "text_column", where, folder, "text-classification")
        if pair is not None:
            _checked_column(rows, pair, "text_pair_column", where, folder, "text-classification")
        check_texts(rows, where, text_column=text, text_pair_column=pair)
        encoded = self.tokenizer(
            list(rows[text]),
            list(rows[pair]) if pair else None,
            truncation=True,
            max_length=self.settings.get("max_length"),
        )
        return [dict(zip(encoded, values)) for values in zip(*encoded.values())]

    def __call__(self, model, examples: list[dict]) -> list[dict]:
        import torch

        batch = {key: value.to(model.device) for key, value in self.collate(examples).items()}
        with torch.no_grad():
            probabilities = model(**batch).logits.float().softmax(dim=-1).cpu()
        return [
            {
                "label": self.labels[int(row.argmax())],
                **{f"probability_{label}": float(p) for label, p in zip(self.labels, row)},
            }
            for row in probabilities
        ]


class _Generator:
    """Prompts (or conversations, through the chat template) -> greedy responses, tokenised as the run's SFT rows
    were."""

    def __init__(self, model, tokenizer, settings: dict, options: PredictOptions):
        from transformers import GenerationConfig

        from .text import generation_batches

        self.tokenizer, self.settings, self.collate = tokenizer, settings, generation_batches(tokenizer)
        self.generation = GenerationConfig(
            max_new_tokens=options.max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=model.generation_config.eos_token_id or tokenizer.eos_token_id,
        )
        limit = getattr(model.config, "max_position_embeddings", None)
        self.longest = None if limit is None else limit - options.max_new_tokens  # a prompt's tokens at most
        if self.longest is not None and self.longest < 1:
            raise ConfigError(
                f"--max-new-tokens {options.max_new_tokens} leaves no room for a prompt: the model reads {limit} tokens"
            )

    def encode(self, rows, column: str | None, where: str, folder: Path) -> list[dict]:
        chat = column is None and self.settings.get("messages_column", "messages") in rows.column_names
        column = column or self.settings.get(
            "messages_column" if chat else "prompt_column", "messages" if chat else "prompt"
        )
        _checked_column(rows, column, "text_column", where, folder, "text-generation")
        if chat:
            prompts = [
                self._conversation(messages, index, where, column) for index, messages in enumerate(rows[column])
            ]
        else:
            from .text import check_texts

            check_texts(rows, where, text_column=column)
            prompts = self.tokenizer(list(rows[column]))["input_ids"]
        cut = [ids[-self.longest :] if self.longest and len(ids) > self.longest else ids for ids in prompts]
        if cut != prompts:
            _log(
                f"{sum(len(a) != len(b) for a, b in zip(cut, prompts))} prompts longer than {self.longest} tokens "
                "(the model's positions less --max-new-tokens) keep their last tokens"
            )
        return [{"input_ids": ids} for ids in cut]

    def _conversation(self, messages, index: int, where: str, column: str) -> list[int]:
        """The conversation up to its last user turn (a final assistant turn is the reference, left out), rendered with
        the chat template's generation prompt."""
        if not self.tokenizer.chat_template:
            raise ConfigError(
                f"{where} has a {column!r} column but the run's tokenizer has no chat template to render it"
            )
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages
        ):
            raise ConfigError(
                f"row {index} of {where}: the {column!r} column holds {shorten(messages)}, not a list of "
                "{'role': ..., 'content': ...} messages"
            )
        if messages and messages[-1].get("role") == "assistant":
            messages = messages[:-1]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def __call__(self, model, examples: list[dict]) -> list[dict]:
        import torch

        batch = {key: value.to(model.device) for key, value in self.collate(examples).items()}
        with torch.no_grad():
            generated = model.generate(**batch, generation_config=self.generation)
        responses = self.tokenizer.batch_decode(generated[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        return [{"response": response} for response in responses]


def _log(message: str) -> None:
    from accelerate.logging import get_logger

    get_logger(__name__).info(message)


def _write(predictions: list[dict], path: Path) -> None:
    """The predictions as a table of the suffix's kind, written whole or not at all (a temporary file, renamed)."""
    import datasets

    table = datasets.Dataset.from_list(predictions)
    partial = path.with_name(f".{path.name}.partial")
    kind = path.suffix.lower()
    if kind == ".csv":
        table.to_csv(partial, index=False)
    elif kind == ".parquet":
        table.to_parquet(partial)
    else:
        table.to_json(partial, lines=kind == ".jsonl", force_ascii=False)
    os.replace(partial, path)


def main(argv: list[str] | None = None) -> int:
    """``acceltrain predict``: exit 0, or 2 with one line on bad input."""
    from .config import parse_config
    from .logs import set_log_level
    from .preemption import EXIT_BAD_INPUT, report_error

    try:
        options = parse_config(
            PredictOptions, sys.argv[1:] if argv is None else argv, description=__doc__, prog="acceltrain predict"
        )
        set_log_level("info")
        from .text import show_progress_bars

        show_progress_bars(False)  # the libraries' (reading the file, loading weights); predict draws its own
        predictions = _predict(options)
    except ConfigError as err:
        report_error(str(err))
        return EXIT_BAD_INPUT
    if os.environ.get("RANK", "0") == "0":
        print(f"wrote {len(predictions)} predictions to {options.output}")
    return 0
