"""Supervised fine-tuning examples for a causal LM: a prompt and its response, or a conversation (a
``messages`` column rendered by the tokenizer's chat template), tokenised with labels on the response tokens
only (-100 elsewhere), one example per sequence (no packing), padded per batch.

A prompt and its response are joined as they are (put any separator in the prompt) and the response ends with
the end-of-text token, so the model learns to stop. In a conversation every assistant turn is a response: its
tokens are those the template adds for it after the generation prompt (``add_generation_prompt=True``) of the
conversation before it (so a conversation starts with a user or system message); a conversation the template
itself refuses (its ``raise_exception``) is one line naming the row. An example longer than ``block_size`` tokens
is cut at the end (its response shortened, counted); one whose prompt leaves no response token within it is
dropped (counted)."""

from __future__ import annotations

from acceltrain.config.options import ConfigError, first_line, shorten
from acceltrain.runtime.distributed import on_main_process_first
from acceltrain.text.corpus import default_num_proc
from acceltrain.text.lm import IGNORE_INDEX

KEPT, TRUNCATED, DROPPED = 0, 1, 2  # what happened to an example at block_size


def sft_examples(
    rows,
    tokenizer,
    *,
    block_size: int,
    where: str,
    prompt: str,
    response: str,
    messages: str | None,
    num_proc: int | None = None,
):
    """Examples with ``input_ids`` and ``labels``, and, until :func:`sft_kept` takes them off, each one's ``length``
    and ``status`` (kept, truncated or dropped at ``block_size``). ``messages``: the conversation column, rendered by
    the chat template, when ``rows`` has it; else ``prompt`` and ``response`` columns. Every row is encoded before
    any is held out for evaluation, so that a message's row number is the file's."""
    chat = messages is not None
    if chat and not tokenizer.chat_template:
        raise ConfigError(
            f"{where} has a {messages!r} column but the tokenizer has no chat template to render it: give a tokenizer "
            "with one (--tokenizer), or prompt and response columns"
        )
    pieces = (
        _conversation_pieces(tokenizer, messages, where)
        if chat
        else _prompt_response_pieces(tokenizer, prompt, response, where)
    )

    def encode(batch, indices):
        encoded = {"input_ids": [], "labels": [], "status": [], "length": [], "error": []}
        for row, index in enumerate(indices):
            ids, labels, error = [], [], None
            try:
                for text, trained, special in pieces({key: values[row] for key, values in batch.items()}, index):
                    tokens = tokenizer(text, add_special_tokens=special)["input_ids"] if isinstance(text, str) else text
                    ids += tokens
                    labels += tokens if trained else [IGNORE_INDEX] * len(tokens)
            except ConfigError as err:  # raised below, in this process: see _raise_first_error
                error = str(err)
            encoded["error"].append(error)
            status = KEPT if len(ids) <= block_size else TRUNCATED
            ids, labels = ids[:block_size], labels[:block_size]
            if all(label == IGNORE_INDEX for label in labels[1:]):  # the first token is never predicted
                status = DROPPED
            encoded["input_ids"].append(ids)
            encoded["labels"].append(labels)
            encoded["status"].append(status)
            encoded["length"].append(len(ids))
        return encoded

    return on_main_process_first(
        lambda: _raise_first_error(
            rows.map(
                encode,
                batched=True,
                with_indices=True,
                num_proc=num_proc or default_num_proc(len(rows)),
                remove_columns=rows.column_names,
                desc="tokenize",
            )
        )
    )


def _raise_first_error(encoded):
    """The first bad row's line, raised here rather than in a tokenising process: an exception that leaves one of
    datasets' ``num_proc`` workers can leave another blocked for good on a lock of the pool (seen as a test that
    never ended)."""
    first = next((error for error in encoded["error"] if error is not None), None)
    if first is not None:
        raise ConfigError(first)
    return encoded.remove_columns("error")


def sft_kept(encoded, *, block_size: int, where: str):
    """(the examples kept, as the model takes them, their lengths, {"truncated": n, "dropped": m}); every example
    dropped is one line."""
    statuses, lengths = list(encoded["status"]), list(encoded["length"])
    counts = {"truncated": statuses.count(TRUNCATED), "dropped": statuses.count(DROPPED)}
    if counts["dropped"] == len(encoded):
        raise ConfigError(
            f"--block-size {block_size}: every example of {where} has a prompt that fills it, leaving no response "
            "token to train on: raise --block-size"
        )
    kept = [index for index, status in enumerate(statuses) if status != DROPPED]
    examples = encoded.remove_columns(["status", "length"])
    if counts["dropped"]:
        examples = examples.select(kept)
    return examples, [lengths[index] for index in kept], counts


def _prompt_response_pieces(tokenizer, prompt: str, response: str, where: str):
    """Row -> [(prompt, not trained, with the tokenizer's special tokens: a BOS),
    (response, trained), (EOS, trained)]."""
    end = tokenizer.eos_token_id
    if end is None:
        raise ConfigError(
            "the tokenizer has no end-of-text token to end each response with: give one that has (--tokenizer)"
        )

    def pieces(row, index):
        question, answer = row[prompt], row[response]
        for column, value in ((prompt, question), (response, answer)):
            if not isinstance(value, str):
                raise ConfigError(f"row {index} of {where}: the {column!r} column holds {shorten(value)}, not text")
        if not answer.strip():
            raise ConfigError(
                f"row {index} of {where}: the response ({response!r} column) is empty: nothing to train on"
            )
        return [(question, False, True), (answer, True, False), ([end], True, False)]

    return pieces


def _conversation_pieces(tokenizer, column: str, where: str):
    """Row -> the rendered conversation cut into pieces, each assistant turn trained: the text the template adds
    for it after the generation prompt of the conversation before it."""

    def render(messages, index: int, **options) -> str:
        from jinja2 import TemplateError

        try:
            return tokenizer.apply_chat_template(messages, tokenize=False, **options)
        except TemplateError as err:  # the template's own raise_exception("Conversation roles must be ...")
            raise ConfigError(
                f"row {index} of {where}: the tokenizer's chat template refuses the conversation: {first_line(err)}"
            ) from None

    def pieces(row, index):
        messages = row[column]
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") for m in messages
        ):
            raise ConfigError(
                f"row {index} of {where}: the {column!r} column holds {shorten(messages)}, not a list of "
                "{'role': ..., 'content': ...} messages"
            )
        turns = [turn for turn, message in enumerate(messages) if message["role"] == "assistant"]
        if not turns:
            raise ConfigError(f"row {index} of {where}: the conversation has no assistant message to train on")
        if turns[0] == 0:  # its generation prompt would be that of an empty conversation, which templates refuse
            raise ConfigError(
                f"row {index} of {where}: the conversation starts with an assistant message, which no "
                "prompt precedes to train it on: start it with a user (or system) message"
            )
        whole, cuts = render(messages, index), []
        for turn in turns:
            if not messages[turn]["content"].strip():
                raise ConfigError(f"row {index} of {where}: assistant message {turn} is empty: nothing to train on")
            start, end = render(messages[:turn], index, add_generation_prompt=True), render(messages[: turn + 1], index)
            if not (whole.startswith(end) and end.startswith(start)):
                raise ConfigError(
                    "the tokenizer's chat template does not render a conversation's beginning as the beginning of the "
                    "whole, so its assistant tokens cannot be told apart: use prompt and response columns"
                )
            cuts.append((len(start), len(end)))
        result, done = [], 0
        for start, end in cuts:
            result += [(whole[done:start], False, False), (whole[start:end], True, False)]
            done = end
        return [piece for piece in [*result, (whole[done:], False, False)] if piece[0]]

    return pieces
