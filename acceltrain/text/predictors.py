"""What ``acceltrain predict`` does with a run's model, per task: rows -> a classifier's predicted label, class
probabilities and (on labelled rows) the task's metrics, or a language model's greedy response to each prompt or
conversation; each tokenised as the run tokenised its own rows."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from acceltrain.config.options import ConfigError, first_line, shorten


def _checked_column(rows, column: str, flag: str, where: str, folder: Path, task: str) -> None:
    from acceltrain.text import check_columns

    try:
        check_columns(rows, where, **{flag: column})
    except ConfigError as err:
        reads = "texts to classify" if task == "text-classification" else "prompts to respond to"
        raise ConfigError(
            f"{err} ({str(folder)!r} is a {task} run folder: it reads {reads}; --text-column names the column)"
        ) from None


class Classifier:
    """Rows -> each one's predicted label and class probabilities, tokenised as the run tokenised its own (columns,
    --max-length); with the row's text (and pair) and, where the file has the run's label column, its true label,
    whose labelled rows give the task's metrics."""

    def __init__(self, model, tokenizer, settings: dict, options):
        from acceltrain.text import classification_batches

        self.tokenizer, self.settings, self.collate = tokenizer, settings, classification_batches(tokenizer)
        self.labels = [model.config.id2label[index] for index in range(model.config.num_labels)]
        self.ids = {name: index for index, name in enumerate(self.labels)}
        self.carried: dict[str, list] = {}  # the input's columns each output row keeps: text (pair), true label
        self.truth: list[int | None] = []  # each row's true class; None: no label
        self.label_column = settings.get("label_column", "label")

    @property
    def scores(self) -> bool:
        """Whether the file has labelled rows: metrics to report."""
        return any(truth is not None for truth in self.truth)

    def encode(self, rows, column: str | None, where: str, folder: Path) -> list[dict]:
        from acceltrain.text import check_texts

        text, pair = column or self.settings.get("text_column", "text"), self.settings.get("text_pair_column")
        _checked_column(rows, text, "text_column", where, folder, "text-classification")
        if pair is not None:
            _checked_column(rows, pair, "text_pair_column", where, folder, "text-classification")
        check_texts(rows, where, text_column=text, text_pair_column=pair)
        carried = [name for name in dict.fromkeys((text, pair, self.label_column)) if name in rows.column_names]
        written = {"predicted_label", *(f"probability_{label}" for label in self.labels)}
        clash = next((name for name in carried if name in written), None)
        if clash is not None:
            raise ConfigError(
                f"the column {clash!r} of {where}, which predict carries into its output, has the name of a column it "
                "writes: rename it"
            )
        self.carried = {name: list(rows[name]) for name in carried}
        if self.label_column in rows.column_names:
            self.truth = [self._class(value, index, where) for index, value in enumerate(rows[self.label_column])]
        encoded = self.tokenizer(
            list(rows[text]),
            list(rows[pair]) if pair else None,
            truncation=True,
            max_length=self.settings.get("max_length"),
        )
        return [dict(zip(encoded, values, strict=True)) for values in zip(*encoded.values(), strict=True)]

    def __call__(self, model, examples: list[dict]) -> list[dict]:
        import torch

        batch = {key: value.to(model.device) for key, value in self.collate(examples).items()}
        with torch.no_grad():
            probabilities = model(**batch).logits.float().softmax(dim=-1).cpu()
        return [
            {
                "predicted_label": self.labels[int(row.argmax())],
                **{f"probability_{label}": float(p) for label, p in zip(self.labels, row, strict=True)},
            }
            for row in probabilities
        ]

    def _class(self, value, index: int, where: str) -> int | None:
        """A true label's class: a class name, or a class id as the run's integer labels (1, 1.0 or "1"); None for a
        row without one (null, or a csv's empty cell: NaN in a column of numbers)."""
        if value is None or isinstance(value, float) and math.isnan(value):
            return None
        found = self.ids.get(str(int(value) if isinstance(value, float) and value.is_integer() else value))
        if found is None:
            shown = ", ".join(shorten(label, 40) for label in self.labels[:10])
            raise ConfigError(
                f"the run's label column {self.label_column!r}: row {index} of {where} has label {shorten(value)}, "
                f"which is not one of the run's classes ({shown}{' ...' if len(self.labels) > 10 else ''}): correct "
                "it, or rename the column to predict without metrics"
            )
        return found

    def finish(self, predictions: list[dict]) -> tuple[list[dict], dict | None]:
        """(the output rows: the carried columns, then the predictions; the metrics of the labelled rows, as
        classification_report.json's with the mean cross-entropy, or None without any)."""
        from acceltrain.text.classification import per_class

        rows = [
            {**{name: values[index] for name, values in self.carried.items()}, **prediction}
            for index, prediction in enumerate(predictions)
        ]
        if not self.truth:  # the file has no label column
            return rows, None
        scored = [(truth, row) for truth, row in zip(self.truth, predictions, strict=True) if truth is not None]
        if not scored:
            return rows, None
        confusion = [[0] * len(self.labels) for _ in self.labels]
        loss = 0.0
        for truth, row in scored:
            confusion[truth][self.ids[row["predicted_label"]]] += 1
            loss -= math.log(max(row[f"probability_{self.labels[truth]}"], sys.float_info.min))
        return rows, {
            "label_column": self.label_column,
            "rows": len(rows),
            "labelled_rows": len(scored),
            "loss": loss / len(scored),
            **per_class(confusion, self.labels),
        }


class Generator:
    """Prompts (or conversations, through the chat template) -> greedy responses, tokenised as the run's SFT rows
    were."""

    def __init__(self, model, tokenizer, settings: dict, options):
        from transformers import GenerationConfig

        from acceltrain.text import generation_batches

        self.tokenizer, self.settings, self.collate = tokenizer, settings, generation_batches(tokenizer)
        self.generation = GenerationConfig(
            max_new_tokens=options.max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=model.generation_config.eos_token_id or tokenizer.eos_token_id,
        )
        limit = getattr(model.config, "max_position_embeddings", None)
        self.longest = None if limit is None else limit - options.max_new_tokens  # a prompt's tokens at most
        self.scores = False  # no metrics: the file's responses are references, not labels
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
            from acceltrain.text import check_texts

            check_texts(rows, where, text_column=column)
            prompts = self.tokenizer(list(rows[column]))["input_ids"]
        cut = [ids[-self.longest :] if self.longest and len(ids) > self.longest else ids for ids in prompts]
        if cut != prompts:
            longer = sum(len(a) != len(b) for a, b in zip(cut, prompts, strict=True))
            _log(
                f"{longer} prompts longer than {self.longest} tokens (the model's positions less --max-new-tokens) "
                "keep their last tokens"
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
        if not messages:  # the chat template would refuse an empty conversation
            raise ConfigError(
                f"row {index} of {where}: the conversation has no message to respond to (a final assistant message is "
                "the reference answer, left out): give it a user message"
            )
        from jinja2 import TemplateError

        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except TemplateError as err:  # the template's own raise_exception("Conversation roles must be ...")
            raise ConfigError(
                f"row {index} of {where}: the tokenizer's chat template refuses the conversation: {first_line(err)}"
            ) from None
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def __call__(self, model, examples: list[dict]) -> list[dict]:
        import torch

        batch = {key: value.to(model.device) for key, value in self.collate(examples).items()}
        with torch.no_grad():
            generated = model.generate(**batch, generation_config=self.generation)
        responses = self.tokenizer.batch_decode(generated[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        return [{"response": response} for response in responses]

    def finish(self, predictions: list[dict]) -> tuple[list[dict], None]:
        return predictions, None


def _log(message: str) -> None:
    from accelerate.logging import get_logger

    get_logger(__name__).info(message)
