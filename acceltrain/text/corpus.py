"""Text for causal language models: raw text in, fixed-length token blocks out.

Text comes from local files (``datasets.load_dataset("text")``, one row per line, line breaks kept) or
from a Hub dataset. The tokenizer is a local one, a Hub one, or a byte-level BPE trained here on the
text and saved as ``<output_dir>/tokenizer.json``, which a resumed run reuses instead of retraining.
Tokenisation is row by row, so its result does not depend on ``num_proc``; packing then concatenates
the rows and cuts the stream into ``block_size`` blocks. A non-empty row without a trailing line break
counts as the end of a document and gets the tokenizer's end-of-text token: a Hub row holding a whole
document, or the last line of a file that does not end with a newline (files that do run on into the
next one: the ``text`` loader does not say where a file ends). A seeded fraction of the blocks is held
out for evaluation. Both steps go through ``Dataset.map`` and its cache: the main process computes,
the others find the cache files (:func:`~acceltrain.runtime.distributed.on_main_process_first`).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
from accelerate.logging import get_logger

from acceltrain.config.options import ConfigError, file_kind
from acceltrain.data.loaders import available_cpus
from acceltrain.runtime.distributed import on_main_process_first, process_state
from acceltrain.runtime.network import load_local_or_hub, one_line

logger = get_logger(__name__)

TOKENIZER_FILE = "tokenizer.json"
END_OF_TEXT = "<|endoftext|>"
PACK_ROWS = 10_000  # rows concatenated per packing batch; each batch drops its last partial block
STREAM_SHUFFLE_BUFFER = 10_000  # blocks (about 20 MB at 256 tokens) a stream is shuffled through


def show_progress_bars(enabled: bool) -> None:
    """The progress bars of datasets (tokenising, packing) and Transformers (loading weights) on or off,
    like the loop's ``--progress``."""
    import datasets
    from transformers.utils import logging as transformers_logging

    if enabled:
        datasets.enable_progress_bars()
        transformers_logging.enable_progress_bar()
    else:
        datasets.disable_progress_bars()
        transformers_logging.disable_progress_bar()


# --------------------------------------------------------------------------- raw text


def expand_text_files(spec: str) -> list[str]:
    """``--text-files``: comma-separated paths or globs, each of which must name at least one file."""
    files: list[str] = []
    for pattern in (part.strip() for part in spec.split(",")):
        if not pattern:
            continue
        matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        if not matches:
            raise ConfigError(f"--text-files {pattern!r} matches no file")
        for match in matches:
            try:
                kind = file_kind(os.stat(match).st_mode)
            except OSError as err:  # a dangling link
                raise ConfigError(f"--text-files {match!r} cannot be read: {err.strerror}") from None
            if kind == "a directory":
                raise ConfigError(
                    f"--text-files {match!r} is a directory: name the files, e.g. {os.path.join(match, '*.txt')!r}"
                )
            if kind:  # a FIFO would block the reader for good, or read as empty
                raise ConfigError(f"--text-files {match!r} is {kind}, not a regular file")
            if match not in files:
                files.append(match)
    if not files:
        raise ConfigError(f"--text-files {spec!r} names no file")
    return [os.path.abspath(path) for path in files]


def load_text(
    text_files: str | None,
    dataset_name: str | None = None,
    dataset_config: str | None = None,
    *,
    streaming: bool = False,
):
    """A ``datasets.Dataset`` with one column, ``text``: the lines of ``text_files`` (line breaks kept)
    or the ``train`` split of the Hub dataset ``dataset_name``; ``streaming``: a ``datasets.IterableDataset``
    read as training goes (one shard per file), nothing loaded or cached up front."""
    import datasets

    if text_files is not None:
        files = expand_text_files(text_files)
        if all(os.path.getsize(path) == 0 for path in files):
            raise ConfigError(f"--text-files {text_files!r}: the files are empty")

        def read():
            try:
                return datasets.load_dataset(
                    "text", data_files=files, split="train", keep_linebreaks=True, streaming=streaming
                )
            except datasets.exceptions.DatasetGenerationError as err:
                reason = one_line(err.__cause__ or err)
                raise ConfigError(f"--text-files {text_files!r} cannot be read as UTF-8 text ({reason})") from None

        texts, flag = on_main_process_first(read), f"--text-files {text_files!r}"
    else:

        def fetch():
            try:
                return datasets.load_dataset(dataset_name, dataset_config, split="train", streaming=streaming)
            except (OSError, ValueError, datasets.exceptions.DatasetsError) as err:
                raise ConfigError(
                    f"--dataset-name {dataset_name!r} could not be loaded from the Hugging Face Hub ({one_line(err)}); "
                    "offline, use --text-files with a local copy"
                ) from None

        texts, flag = on_main_process_first(fetch), f"--dataset-name {dataset_name!r}"
        if "text" not in texts.column_names:
            raise ConfigError(f"{flag} has no 'text' column (columns: {', '.join(texts.column_names)})")
        texts = texts.select_columns(["text"])
    if (next(iter(texts.take(1)), None) is None) if streaming else len(texts) == 0:
        raise ConfigError(f"{flag} holds no text")
    return texts


# --------------------------------------------------------------------------- tokenizer


def load_tokenizer(source: str, flag: str):
    """A tokenizer from a ``tokenizer.json`` file, a local folder, or (online) a Hub name."""
    from transformers import AutoTokenizer

    path = Path(source).expanduser()
    if path.is_file():
        return _as_transformers_tokenizer(_read_tokenizer_file(path, flag))
    return load_local_or_hub(AutoTokenizer.from_pretrained, source, flag, "a tokenizer")


def tokenizer_for_run(
    source: str | None, flag: str, texts, output_dir: Path, vocab_size: int, *, resuming: bool = False
):
    """The tokenizer named by ``source``; without one, when ``resuming``, the run's own
    ``<output_dir>/tokenizer.json`` (its checkpoints were trained on that vocabulary), else a byte-level
    BPE trained on ``texts`` by the main process and saved there for the other processes and for
    resumes. It is trained on all of the text: the held-out blocks shape the vocabulary, never the
    model's weights."""
    if source is not None:
        return on_main_process_first(lambda: load_tokenizer(source, flag))
    saved = output_dir / TOKENIZER_FILE
    state = process_state()

    def trained_or_reused():
        if not state.is_main_process:  # the main process went first: its file is the run's tokenizer
            return _read_tokenizer_file(saved, "--output-dir")
        if resuming and saved.is_file():
            tokenizer = _read_tokenizer_file(saved, "--output-dir")
            logger.info(f"tokenizer: reusing {saved} (vocabulary {tokenizer.get_vocab_size()})")
            return tokenizer
        tokenizer = train_byte_level_bpe(texts, vocab_size)
        output_dir.mkdir(parents=True, exist_ok=True)
        save_tokenizer(_as_transformers_tokenizer(tokenizer), output_dir)
        logger.info(f"tokenizer: trained a byte-level BPE of {tokenizer.get_vocab_size()} tokens, saved to {saved}")
        return tokenizer

    return _as_transformers_tokenizer(on_main_process_first(trained_or_reused))


def save_tokenizer(tokenizer, output_dir: Path) -> None:
    """``tokenizer.save_pretrained(output_dir)`` (``tokenizer.json`` and its config, which
    ``AutoTokenizer`` needs for the end-of-text token), staged and moved in with ``tokenizer.json`` last:
    a crash mid-write never leaves a truncated file for a resume to reuse. Saving again gives the same bytes."""
    staging = output_dir / f".tmp-tokenizer-{os.getpid()}"
    tokenizer.save_pretrained(staging)
    for name in sorted(os.listdir(staging), key=lambda name: name == TOKENIZER_FILE):
        os.replace(staging / name, output_dir / name)
    staging.rmdir()


def train_byte_level_bpe(texts, vocab_size: int):
    """A GPT-2 style byte-level BPE (any byte sequence is encodable, no unknown token) with one special
    token, ``<|endoftext|>``, trained on the ``text`` column."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    batches = (texts[start : start + 1000]["text"] for start in range(0, len(texts), 1000))
    tokenizer.train_from_iterator(batches, trainer=trainer, length=len(texts))
    return tokenizer


def _read_tokenizer_file(path: Path, flag: str):
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception on malformed JSON
        raise ConfigError(f"{flag} {str(path)!r} is not a tokenizers JSON file ({one_line(err)})") from None


def _as_transformers_tokenizer(tokenizer):
    """The Transformers interface around a ``tokenizers.Tokenizer``, end-of-text token set when it has one."""
    from transformers import PreTrainedTokenizerFast

    eos = END_OF_TEXT if tokenizer.token_to_id(END_OF_TEXT) is not None else None
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos)


# --------------------------------------------------------------------------- blocks


def default_num_proc(rows: int) -> int:
    """Tokenising processes: one per CPU, at most 8, and none beyond one per 10,000 rows (forking costs more
    than it saves on small text)."""
    return max(1, min(8, available_cpus(), rows // 10_000))


def token_blocks(texts, tokenizer, *, block_size: int, num_proc: int | None = None):
    """``texts`` tokenised (``num_proc`` processes, default :func:`default_num_proc`) and packed into rows
    of exactly ``block_size`` tokens."""
    num_proc = num_proc or default_num_proc(len(texts))
    tokenize, pack = _tokenize_and_pack(tokenizer, block_size)

    def build():
        tokens = _tokenized(texts, tokenize, num_proc)
        # packing runs in one process: batches then start at the same rows whatever num_proc is
        packed = tokens.with_format("numpy").map(
            pack, batched=True, batch_size=PACK_ROWS, desc=f"pack into blocks of {block_size}"
        )
        return packed, tokens

    blocks, tokens = on_main_process_first(build)
    if len(blocks) == 0:
        total = sum(len(ids) for ids in tokens["input_ids"])
        raise ConfigError(
            f"--block-size {block_size} is too long for the text: it holds {total} tokens, packed {PACK_ROWS} lines at "
            "a time"
        )
    return blocks


def token_rows(texts, tokenizer, *, num_proc: int | None = None):
    """``texts`` tokenised row by row, as :func:`token_blocks` does before it packs them (an end-of-text token
    after each document)."""
    tokenize, _ = _tokenize_and_pack(tokenizer, 2)
    return on_main_process_first(lambda: _tokenized(texts, tokenize, num_proc or default_num_proc(len(texts))))


def _tokenized(texts, tokenize: Callable, num_proc: int):
    return texts.map(tokenize, batched=True, num_proc=num_proc, remove_columns=texts.column_names, desc="tokenize")


def _tokenize_and_pack(tokenizer, block_size: int) -> tuple[Callable, Callable]:
    """The two batched maps from text rows to blocks: ``tokenize`` (row by row, an end-of-text token after a
    document) and ``pack`` (concatenate, cut into ``block_size`` rows, drop the partial last block)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # map and loader workers fork after the tokenizer ran
    end_of_text = tokenizer.eos_token_id

    def tokenize(batch):
        rows = tokenizer(batch["text"], add_special_tokens=False, return_attention_mask=False)["input_ids"]
        if end_of_text is not None:
            ends = [bool(text) and not text.endswith("\n") for text in batch["text"]]
            rows = [ids + [end_of_text] if end else ids for ids, end in zip(rows, ends, strict=True)]
        return {"input_ids": rows}

    def pack(batch):
        stream = np.concatenate([np.asarray(ids, dtype=np.int64) for ids in batch["input_ids"]])
        usable = len(stream) - len(stream) % block_size
        return {"input_ids": stream[:usable].reshape(-1, block_size)}

    return tokenize, pack


def streamed_blocks(texts, tokenizer, *, block_size: int, seed: int, shuffle_buffer: int = STREAM_SHUFFLE_BUFFER):
    """A text stream tokenised and packed on the fly, as :func:`token_blocks` packs (``PACK_ROWS`` lines at a
    time, so the same blocks), shuffled by ``seed`` and pass through a buffer of ``shuffle_buffer`` blocks."""
    tokenize, pack = _tokenize_and_pack(tokenizer, block_size)
    tokens = texts.map(tokenize, batched=True, remove_columns=["text"])
    blocks = tokens.map(pack, batched=True, batch_size=PACK_ROWS)
    return blocks.shuffle(seed=seed, buffer_size=shuffle_buffer).with_format("torch")


def held_out_lines(texts, count: int):
    """(the first ``count`` lines of a text stream in memory, the stream after them)."""
    import datasets

    head = list(texts.take(count))
    return datasets.Dataset.from_list(head) if head else None, texts.skip(count)


def split_blocks(blocks, *, eval_fraction: float, seed: int):
    """(train, eval) torch-formatted datasets: a seeded ``eval_fraction`` of the blocks held out (at least
    one when the fraction is not 0), the rest for training; eval is None when the fraction is 0."""
    from acceltrain.text.tables import hold_out

    train, held_out = hold_out(
        blocks,
        eval_fraction,
        seed,
        unit="blocks in the text",
        remedy="more text, a smaller --block-size or a smaller --eval-fraction",
    )
    return train.with_format("torch"), held_out.with_format("torch") if held_out is not None else None
