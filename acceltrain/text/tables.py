"""Rows of text for fine-tuning: local csv, json/jsonl or parquet files, or a Hub dataset's splits, read by
``datasets.load_dataset`` (cached; the main process first, see
:func:`~acceltrain.runtime.distributed.on_main_process_first`); the columns a recipe asks for checked against the ones
there are; a seeded share held out for evaluation when there is no eval file."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import torch

from acceltrain.config.options import ConfigError, file_kind
from acceltrain.data.loaders import mix_seed
from acceltrain.runtime.distributed import on_main_process_first
from acceltrain.runtime.network import one_line

TABLE_KINDS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
EVAL_SPLITS = ("validation", "test")  # a Hub dataset's split for evaluation, the first there is


def load_rows(train_file: str | None, eval_file: str | None, dataset_name: str | None, dataset_config: str | None):
    """(train rows, eval rows or None, train's description, eval's description): ``--train-file``/``--eval-file``,
    or the Hub dataset's ``train`` split and its first of ``validation``/``test`` (when there is no eval file).
    A description names the source in messages (``--train-file 'x.csv'``)."""
    if train_file is not None:
        train, train_where = load_table(train_file, "--train-file"), f"--train-file {train_file!r}"
        eval_rows, eval_where = None, None
    else:
        splits = _hub_splits(dataset_name, dataset_config)
        if "train" not in splits:
            raise ConfigError(f"--dataset-name {dataset_name!r} has no 'train' split (splits: {', '.join(splits)})")
        train, train_where = splits["train"], f"--dataset-name {dataset_name!r} (split train)"
        split = next((name for name in EVAL_SPLITS if name in splits), None)
        eval_rows, eval_where = (
            (splits[split], f"--dataset-name {dataset_name!r} (split {split})") if split else (None, None)
        )
    if eval_file is not None:
        eval_rows, eval_where = load_table(eval_file, "--eval-file"), f"--eval-file {eval_file!r}"
    return train, eval_rows, train_where, eval_where


def load_table(path: str, flag: str):
    """One file's rows; its kind from its suffix. A missing, special, empty or unreadable file, or one without
    rows, is one line naming ``flag``."""
    import datasets

    shown = f"{flag} {path!r}"
    kind = TABLE_KINDS.get(Path(path).suffix.lower())
    if kind is None:
        raise ConfigError(f"{shown}: read files are {', '.join(TABLE_KINDS)} (the suffix says the format)")
    try:
        special = file_kind(os.stat(os.path.expanduser(path)).st_mode)
    except OSError as err:
        raise ConfigError(f"{shown} cannot be read: {err.strerror}") from None
    if special:
        raise ConfigError(f"{shown} is {special}, not a regular file")
    if os.path.getsize(os.path.expanduser(path)) == 0:
        raise ConfigError(f"{shown} is empty")

    def read():
        try:
            with _quiet("datasets"):
                return datasets.load_dataset(kind, data_files=os.path.abspath(os.path.expanduser(path)), split="train")
        except datasets.exceptions.DatasetGenerationError as err:
            raise ConfigError(f"{shown} cannot be read as {kind} ({one_line(err.__cause__ or err)})") from None
        except ValueError as err:
            if "corresponds to no data" in str(err):  # datasets' words for a file with a header and no row
                raise ConfigError(f"{shown} holds no rows") from None
            raise ConfigError(f"{shown} cannot be read as {kind} ({one_line(err)})") from None

    rows = on_main_process_first(read)
    if len(rows) == 0:
        raise ConfigError(f"{shown} holds no rows")
    return rows


def _hub_splits(name: str, config: str | None) -> dict:
    import datasets

    def fetch():
        try:
            with _quiet("datasets"):
                return datasets.load_dataset(name, config)
        except (OSError, ValueError, datasets.exceptions.DatasetsError) as err:
            raise ConfigError(
                f"--dataset-name {name!r} could not be loaded from the Hugging Face Hub ({one_line(err)}); "
                "offline, use --train-file with a local copy"
            ) from None

    return dict(on_main_process_first(fetch))


@contextlib.contextmanager
def _quiet(library: str):
    """The library's own error records (``Failed to load JSON ...``) kept off the console while its failure
    becomes one line here."""
    logger = logging.getLogger(library)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def check_columns(rows, where: str, **columns: str | None) -> None:
    """Each ``flag=column`` (``text_column="text"``) names a column of ``rows``;
    else one line with the columns there are."""
    for flag, column in columns.items():
        if column is not None and column not in rows.column_names:
            raise ConfigError(
                f"--{flag.replace('_', '-')} {column!r} is not a column of {where}: its columns are "
                f"{', '.join(rows.column_names)}"
            )


def hold_out(
    rows, fraction: float, seed: int, *, unit: str = "rows", remedy: str = "more data or a smaller --eval-fraction"
):
    """(train, held out): a seeded ``fraction`` of ``rows`` held out (at least one when it is not 0; None when it
    is), both in their original order."""
    if fraction == 0:
        return rows, None
    held = max(1, round(fraction * len(rows)))
    if held >= len(rows):
        raise ConfigError(
            f"--eval-fraction {fraction} leaves no training data: there are only {len(rows)} {unit}; use {remedy}"
        )
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(mix_seed(seed, 0xE7A1))).tolist()
    eval_rows, train_rows = sorted(order[:held]), sorted(order[held:])
    return rows.select(train_rows, keep_in_memory=True), rows.select(eval_rows, keep_in_memory=True)
