"""A pretrained Transformers model fine-tuned as a text classifier (every weight, or a LoRA adapter) with the
acceltrain loop.

    acceltrain-text-classification --config text_classification_cpu --model-name-or-path path/to/bert \\
        --train-file train.csv --eval-file test.csv
    accelerate launch --config_file accelerate_configs/single_gpu.yaml -m acceltrain.recipes.text_classification \\
        --config text_classification_gpu --model-name-or-path google-bert/bert-base-uncased \\
        --dataset-name stanfordnlp/imdb

Rows come from csv, json/jsonl or parquet files (or a Hub dataset, online); labels are class names or class ids
0..K-1, recorded as id2label/label2id in config.json; batches are padded per batch. The output folder loads
with AutoModelForSequenceClassification.from_pretrained; with --lora-r it is a PEFT adapter folder
(AutoPeftModelForSequenceClassification, its README.md shows the call), with --merge-lora the merged model.
Every flag: acceltrain-text-classification --help (or python recipes/text_classification.py --help in a checkout)
"""

import dataclasses
from dataclasses import dataclass
from typing import Literal

from acceltrain import ConfigError, TrainConfig, option, require, run_recipe
from acceltrain.config.train_config import LRSchedule, Optimizer
from acceltrain.hf.lora import LoraOptions
from acceltrain.text import transformer_default

__all__ = ["TextClassificationConfig", "cli", "main"]

NAME = "text_classification"
MAX_LENGTH = 256  # without --max-length, cut to the model's positions when it has fewer
ClassWeights = Literal["none", "balanced"]


@dataclass
class TextClassificationConfig(LoraOptions, TrainConfig):
    # the loop's defaults suit CIFAR; these suit fine-tuning a pretrained transformer (BERT's paper: AdamW, 2e-5..5e-5)
    batch_size: int = transformer_default("batch_size", 32)
    epochs: float = transformer_default("epochs", 3.0)
    optimizer: Optimizer = transformer_default("optimizer", "adamw")
    lr: float = transformer_default("lr", 5e-5)
    weight_decay: float = transformer_default("weight_decay", 0.01)
    lr_schedule: LRSchedule = transformer_default("lr_schedule", "linear")
    max_grad_norm: float | None = transformer_default("max_grad_norm", 1.0)
    # model
    model_name_or_path: str | None = option(
        None, "the pretrained model to fine-tune: a local folder, or a Hub name when online"
    )
    tokenizer: str | None = option(
        None, "tokenizer.json, tokenizer folder or Hub name; default: the --model-name-or-path folder's"
    )
    # data
    train_file: str | None = option(None, "training rows: a .csv, .json, .jsonl or .parquet file")
    eval_file: str | None = option(
        None,
        "evaluation rows, in the same format; default: the --dataset-name's validation (or test) split, "
        "else --eval-fraction of the training rows",
    )
    dataset_name: str | None = option(
        None, "Hub dataset instead of --train-file (online only): its train split, and validation or test"
    )
    dataset_config: str | None = option(None, "configuration of --dataset-name")
    text_column: str = option("text", "the column of text to classify")
    text_pair_column: str | None = option(None, "a second text column, for pairs of texts (entailment, paraphrase)")
    label_column: str = option("label", "the column of labels: class names (strings) or class ids 0..K-1 (integers)")
    max_length: int | None = option(
        None,
        "tokens per example at most: longer ones are cut (counted in summary.json as truncated_examples); "
        f"default: {MAX_LENGTH}, or the model's positions when it has fewer",
    )
    eval_fraction: float = option(
        0.1, "without eval rows: the fraction of the training rows held out for evaluation, chosen by --seed"
    )
    group_by_length: bool = option(
        False, "batches of examples of similar lengths (less padding; still exactly resumable)"
    )
    # loss
    label_smoothing: float = option(
        0.0,
        "cross-entropy on targets smoothed by this much (Trainer's label_smoothing_factor); the training "
        "loss only: eval_loss stays the plain cross-entropy",
    )
    class_weights: ClassWeights = option(
        "none",
        "balanced: each class's loss weighed by training rows / (classes x its training rows) (scikit-learn's "
        "'balanced', in summary.json); the training loss only",
    )
    num_proc: int | None = option(
        None,
        "processes that tokenise the rows (default: one per CPU and per 10,000 rows, at most 8)",
        free_on_resume=True,
    )

    def validate(self) -> None:
        super().validate()
        if self.model_name_or_path is None:
            raise ConfigError(
                "give the pretrained model to fine-tune with --model-name-or-path (a local folder, or a Hub name "
                "online)"
            )
        if (self.train_file is None) == (self.dataset_name is None):
            raise ConfigError("give the training rows with exactly one of --train-file FILE and --dataset-name NAME")
        if self.dataset_config is not None and self.dataset_name is None:
            raise ConfigError("--dataset-config needs --dataset-name")
        if self.max_length is not None:
            require(self.max_length >= 2, "max_length", self.max_length, "an integer >= 2")
        require(0 <= self.eval_fraction < 1, "eval_fraction", self.eval_fraction, "a fraction in [0, 1)")
        require(0 <= self.label_smoothing < 1, "label_smoothing", self.label_smoothing, "a number in [0, 1)")
        if self.num_proc is not None:
            require(self.num_proc >= 1, "num_proc", self.num_proc, "an integer >= 1")


def main(cfg: TextClassificationConfig) -> dict:
    # imported here, not at the top: --help and bad flags answer in a fraction of a second, without torch
    from acceltrain import apply_lora, build_optimizer, claim_run_folder, fit, show_progress
    from acceltrain.hf.lora import check_backend
    from acceltrain.text import (
        ClassificationReport,
        DataReport,
        LengthGrouped,
        TextClassificationTask,
        balanced_class_weights,
        check_columns,
        check_vocabulary,
        classification_batches,
        classification_examples,
        encode_classification,
        file_fingerprint,
        first_epoch_padding,
        fitting_length,
        flops_per_block,
        hold_out,
        load_pretrained,
        load_rows,
        pretrained_tokenizer,
        read_labels,
        save_tokenizer,
        show_progress_bars,
    )

    if cfg.lora_r is not None:
        check_backend(merge=cfg.merge_lora)
    folder = claim_run_folder(cfg, NAME)  # the output folder first: the tokenizer is saved there before training
    cfg, output_dir = folder.cfg, folder.output_dir
    show_progress_bars(show_progress(cfg.progress) and folder.is_main_process)
    with folder.left_as_found():  # bad input leaves nothing behind; a failure once training started keeps everything
        train_rows, eval_rows, train_where, eval_where = load_rows(
            cfg.train_file, cfg.eval_file, cfg.dataset_name, cfg.dataset_config
        )
        columns = {
            "text_column": cfg.text_column,
            "text_pair_column": cfg.text_pair_column,
            "label_column": cfg.label_column,
        }
        for rows, where in ((train_rows, train_where), (eval_rows, eval_where)):
            if rows is not None:
                check_columns(rows, where, **columns)
        labels = read_labels(train_rows, eval_rows, cfg.label_column, train_where, eval_where)
        tokenizer = pretrained_tokenizer(cfg.tokenizer, cfg.model_name_or_path)
        model, missing = load_pretrained(
            "AutoModelForSequenceClassification",
            cfg.model_name_or_path,
            num_labels=len(labels.names),
            id2label=labels.id2label,
            label2id=labels.label2id,
            pad_token_id=tokenizer.pad_token_id,
            ignore_mismatched_sizes=True,
        )
        check_vocabulary(model, tokenizer, cfg.model_name_or_path)
        max_length = fitting_length(cfg.max_length, MAX_LENGTH, "--max-length", model, cfg.model_name_or_path)
        cfg = dataclasses.replace(cfg, max_length=max_length)
        if cfg.lora_r is not None:
            model = apply_lora(model, cfg, missing_keys=missing)
        encoding = {
            "text": cfg.text_column,
            "pair": cfg.text_pair_column,
            "label": cfg.label_column,
            "max_length": cfg.max_length,
            "num_proc": cfg.num_proc,
        }
        train_set = encode_classification(train_rows, tokenizer, labels, where=train_where, **encoding)
        if eval_rows is None:
            train_set, eval_set = hold_out(train_set, cfg.eval_fraction, cfg.seed)
        else:
            eval_set = encode_classification(eval_rows, tokenizer, labels, where=eval_where, **encoding)
        train_set, lengths, train_truncated = classification_examples(train_set)
        eval_set, _, eval_truncated = classification_examples(eval_set) if eval_set is not None else (None, None, 0)
        if (
            cfg.train_file is not None
        ):  # a resume refuses rows that changed since (a Hub dataset has no fingerprint here)
            train_set.fingerprint = file_fingerprint(cfg.train_file, cfg.eval_file)
        weights = balanced_class_weights(train_set["labels"], labels.names) if cfg.class_weights == "balanced" else None
        if cfg.group_by_length:
            train_set = LengthGrouped(train_set, lengths, batch_size=cfg.batch_size, seed=cfg.seed)
        tokens = sum(lengths) / len(lengths)  # an example's mean, padding left out
        task = TextClassificationTask(
            labels.names,
            tokens_per_sample=tokens,
            flops_per_sample=flops_per_block(model, tokens),
            label_smoothing=cfg.label_smoothing,
            class_weights=weights,
        )
        report = DataReport(
            {
                "truncated_examples": {"train": train_truncated, "eval": eval_truncated},
                "padded_token_fraction": first_epoch_padding(
                    train_set, lengths, batch_size=cfg.batch_size, seed=cfg.seed
                ),
                **({"class_weights": dict(zip(labels.names, weights, strict=True))} if weights is not None else {}),
            }
        )
        if folder.is_main_process:  # before training: the run folder loads with from_pretrained, tokenizer included
            save_tokenizer(tokenizer, output_dir)
        return fit(
            cfg,
            model,
            build_optimizer(model, cfg),
            train_set,
            eval_set,
            task=task,
            name=NAME,
            hooks=[ClassificationReport(task), report],
            collate_fn=classification_batches(tokenizer),
        )


def cli() -> None:
    """The command line (console script, ``python -m``, ``accelerate launch``); returns nothing, so that the
    console script's ``sys.exit(cli())`` exits 0."""
    run_recipe(main, TextClassificationConfig, description=__doc__)


if __name__ == "__main__":
    cli()
