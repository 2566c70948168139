"""Rows of text and labels -> tokenised examples for a sequence classifier: labels checked and numbered (names
kept for the model's ``id2label``), text (and an optional second text of a pair) tokenised with
``Dataset.map`` (cached, the main process first), truncated at ``max_length`` with the truncated examples
counted. Examples keep their own lengths: batches are padded per batch (``DataCollatorWithPadding``).
Every row is checked and encoded before any is held out for evaluation, so that a message's row number is the
file's."""

from __future__ import annotations

from dataclasses import dataclass

from accelerate.logging import get_logger

from acceltrain.config.options import ConfigError, shorten
from acceltrain.runtime.distributed import on_main_process_first
from acceltrain.text.corpus import default_num_proc

logger = get_logger(__name__)
MODEL_COLUMNS = ("input_ids", "attention_mask", "token_type_ids", "labels")


@dataclass(frozen=True)
class Labels:
    """The classes: ``names[i]`` is class i; ``ids`` maps a label as it appears in the data to its class."""

    names: list[str]
    ids: dict

    @property
    def id2label(self) -> dict[int, str]:
        return dict(enumerate(self.names))

    @property
    def label2id(self) -> dict[str, int]:
        return {name: index for index, name in enumerate(self.names)}


def read_labels(train, eval_rows, column: str, train_where: str, eval_where: str | None) -> Labels:
    """The classes of the label column: strings are class names (sorted); integers are class ids when they are
    exactly 0..K-1, K the number of distinct training labels, else class names sorted numerically (1, 2, 3, 5, 7,
    8: a csv reads digits as integers), as transformers' run_glue.py reads them, logged (a Hub ``ClassLabel``
    brings its names). Missing labels, other types, a column mixing integers and strings, a single class and
    evaluation labels the training rows do not have are one line each."""
    feature = train.features[column]
    if hasattr(feature, "names"):  # datasets.ClassLabel: ids with names
        return Labels(list(feature.names), {index: index for index in range(len(feature.names))})
    values = {
        where: _checked(rows[column], where, column)
        for rows, where in ((train, train_where), (eval_rows, eval_where))
        if rows is not None
    }
    kinds = {where: _kind(labels, where, column) for where, labels in values.items()}
    if len(set(kinds.values())) > 1:
        raise ConfigError(
            f"--label-column {column!r} holds {kinds[train_where]} labels in {train_where} and {kinds[eval_where]} "
            f"labels in {eval_where}: use one kind (class names, or class ids 0..K-1)"
        )
    trained = sorted(set(values[train_where]))
    ids = {label: index for index, label in enumerate(trained)}  # class ids 0..K-1 are their own
    if len(ids) < 2:
        raise ConfigError(
            f"--label-column {column!r}: {train_where} has a single label, {shorten(trained[0])}: a classifier "
            "needs at least 2 classes"
        )
    if eval_where is not None:
        unknown = sorted(set(values[eval_where]) - ids.keys(), key=str)
        if unknown:
            raise ConfigError(
                f"--label-column {column!r}: {eval_where} has label {shorten(unknown[0])}, which no training row has "
                f"(training labels: {_listed(trained)})"
            )
    if kinds[train_where] == "integer" and trained != list(range(len(trained))):
        logger.info(
            f"labels {_listed(trained)} are not the class ids 0..{len(trained) - 1}: read as {len(trained)} class names"
        )
    return Labels([str(label) for label in ids], ids)


def _listed(labels: list, shown: int = 10) -> str:
    """The first ``shown`` labels, as a message names them."""
    return ", ".join(shorten(label, 40) for label in labels[:shown]) + (" ..." if len(labels) > shown else "")


def _checked(labels: list, where: str, column: str) -> list:
    """The labels as ints or strings (integral floats, as a csv with gaps reads them, as ints); None, booleans and
    other types are refused with their row."""
    checked = []
    for row, label in enumerate(labels):
        if isinstance(label, float) and label.is_integer():
            label = int(label)
        if label is None or isinstance(label, bool) or not isinstance(label, (int, str)):
            what = "no label" if label is None else f"label {shorten(label)}, a {type(label).__name__}"
            raise ConfigError(
                f"--label-column {column!r}: row {row} of {where} has {what}; labels are class names (strings) "
                "or class ids (integers)"
            )
        checked.append(label)
    return checked


def _kind(labels: list, where: str, column: str) -> str:
    """ "integer" or "string"; in a csv, whose columns are untyped, numbers among names are integers too."""
    kind_of = [int if isinstance(label, int) or _integer_like(label) else str for label in labels]
    kinds = set(kind_of)
    if len(kinds) > 1:
        first = {kind: kind_of.index(kind) for kind in kinds}
        raise ConfigError(
            f"--label-column {column!r} of {where} mixes integers and strings (the integer {labels[first[int]]!r} in "
            f"row {first[int]}, the string {shorten(labels[first[str]])} in row {first[str]}): use one kind (class "
            "names, or class ids)"
        )
    return "integer" if {type(label) for label in labels} == {int} else "string"


def _integer_like(label) -> bool:
    return isinstance(label, str) and label.strip().lstrip("+-").isdigit()


def check_texts(rows, where: str, **columns: str | None) -> None:
    """Each ``flag=column`` (``text_column="text"``) holds text in every row of ``rows``; else one line naming the
    row."""
    for flag, column in columns.items():
        if column is not None:
            missing = next((row for row, value in enumerate(rows[column]) if not isinstance(value, str)), None)
            if missing is not None:
                raise ConfigError(
                    f"--{flag.replace('_', '-')} {column!r}: row {missing} of {where} has no text "
                    f"({shorten(rows[column][missing])})"
                )


def encode_classification(
    rows,
    tokenizer,
    labels: Labels,
    *,
    text: str,
    pair: str | None,
    label: str,
    max_length: int,
    where: str,
    num_proc: int | None = None,
):
    """Examples with ``input_ids``, ``attention_mask`` (``token_type_ids``) and ``labels``, and, until
    :func:`classification_examples` takes them off, each one's ``length`` and whether it was ``truncated``."""
    check_texts(rows, where, text_column=text, text_pair_column=pair)

    def encode(batch):
        encoded = tokenizer(batch[text], batch[pair] if pair else None, truncation=True, max_length=max_length)
        if encoded.encodings is not None:  # a fast tokenizer keeps what truncation cut off
            truncated = [bool(encoding.overflowing) for encoding in encoded.encodings]
        else:
            whole = tokenizer(batch[text], batch[pair] if pair else None)["input_ids"]
            truncated = [len(ids) > max_length for ids in whole]
        return {
            **encoded,
            "labels": [labels.ids[value if not isinstance(value, float) else int(value)] for value in batch[label]],
            "truncated": truncated,
            "length": [len(ids) for ids in encoded["input_ids"]],
        }

    return on_main_process_first(
        lambda: rows.map(
            encode,
            batched=True,
            num_proc=num_proc or default_num_proc(len(rows)),
            remove_columns=rows.column_names,
            desc="tokenize",
        )
    )


def classification_examples(encoded):
    """(the examples as the model takes them, their lengths, how many were truncated)."""
    lengths, truncated = list(encoded["length"]), sum(encoded["truncated"])
    return (
        encoded.select_columns([column for column in MODEL_COLUMNS if column in encoded.column_names]),
        lengths,
        truncated,
    )
