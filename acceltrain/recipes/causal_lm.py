"""A causal language model (GPT-2 or Llama style, Transformers) on local text with the acceltrain loop, or a
pretrained one fine-tuned on prompts and responses (SFT).

    acceltrain-causal-lm --config lm_tiny_cpu --text-files ../shared/datasets/tinyshakespeare.txt
    accelerate launch --config_file accelerate_configs/single_gpu.yaml -m acceltrain.recipes.causal_lm \\
        --config lm_gpt2_124m_gpu --text-files 'corpus/*.txt'
    acceltrain-causal-lm --model-name-or-path path/to/model --train-file sft.jsonl --lora-r 16 --lr 2e-4   # SFT

Without --tokenizer a byte-level BPE is trained on the text and kept as <output-dir>/tokenizer.json
(reused on --resume). With --train-file, the rows are prompt and response columns or a messages column
(rendered by the tokenizer's chat template), and the loss counts response tokens only. --packing puts several
examples (or, with --text-files, documents) in each row of --block-size tokens, checked exact before training.
The output folder (weights, config, tokenizer) loads with AutoModelForCausalLM.from_pretrained and
AutoTokenizer.from_pretrained; with --lora-r it is a PEFT adapter folder (AutoPeftModelForCausalLM), with
--merge-lora the merged model.
Every flag: acceltrain-causal-lm --help (or python recipes/causal_lm.py --help in a checkout)
"""

import dataclasses
from dataclasses import dataclass

from acceltrain import ConfigError, TrainConfig, option, require, run_recipe
from acceltrain.config.train_config import Optimizer
from acceltrain.hf.lora import LoraOptions
from acceltrain.text import MODEL_PRESETS, transformer_default

__all__ = ["CausalLMConfig", "cli", "main"]

NAME = "causal_lm"
BLOCK_SIZE = 256  # without --block-size: a pretrained model's positions when it has fewer
BPE_LINES = 2000  # with --streaming --eval-lines 0: the stream's first lines that train a BPE (not held out)


@dataclass
class CausalLMConfig(LoraOptions, TrainConfig):
    # the loop's defaults suit CIFAR; these suit a transformer (GPT-2 recipes)
    batch_size: int = transformer_default("batch_size", 16)
    optimizer: Optimizer = transformer_default("optimizer", "adamw")
    lr: float = transformer_default("lr", 6e-4)
    weight_decay: float = transformer_default("weight_decay", 0.1)
    max_grad_norm: float | None = transformer_default("max_grad_norm", 1.0)
    # model
    model: str = option("gpt2-tiny", "architecture-size of a freshly initialised model", choices=MODEL_PRESETS)
    model_name_or_path: str | None = option(
        None, "start from this pretrained model instead (local folder; Hub name when online)"
    )
    dropout: float = option(
        0.0, "dropout of a --model preset (GPT-2: embeddings, residuals, attention; Llama: attention)"
    )
    # data
    text_files: str | None = option(
        None, "comma-separated text files or globs ('data/*.txt'), read line by line (a list in YAML)", list_like=True
    )
    dataset_name: str | None = option(None, "Hub dataset with a 'text' column, instead of --text-files (online only)")
    train_file: str | None = option(
        None,
        "supervised fine-tuning (SFT) rows instead of --text-files: a .jsonl, .json, .csv or .parquet file of prompt "
        "and response columns, or of a messages column (a conversation, rendered by the tokenizer's chat template)",
    )
    eval_file: str | None = option(
        None, "SFT rows for evaluation, in the same format (default: --eval-fraction of the --train-file rows)"
    )
    prompt_column: str = option("prompt", "with --train-file: the prompt column (not trained on)")
    response_column: str = option(
        "response", "with --train-file: the response column (its tokens alone are trained on)"
    )
    messages_column: str = option("messages", "with --train-file: the conversation column, used when the file has it")
    group_by_length: bool = option(
        False, "with --train-file: batches of examples of similar lengths (less padding; still exactly resumable)"
    )
    packing: bool = option(
        False,
        "several examples (SFT rows; with --text-files, documents cut at --block-size) in each row of --block-size "
        "tokens, best-fit-decreasing, position ids restarting at each, no padding between them: exact for models "
        "whose attention takes packed rows (checked before training)",
    )
    dataset_config: str | None = option(None, "configuration of --dataset-name (e.g. wikitext-103-raw-v1)")
    tokenizer: str | None = option(
        None,
        "tokenizer.json, tokenizer folder or Hub name; default: the --model-name-or-path folder's, else a BPE trained "
        "on the text",
    )
    vocab_size: int = option(8192, "vocabulary of the BPE trained when there is no --tokenizer")
    block_size: int | None = option(
        None,
        "tokens per training sequence (context length); with --train-file, per example at most (longer ones "
        f"cut); default: {BLOCK_SIZE}, or the --model-name-or-path model's positions when it has fewer",
    )
    eval_fraction: float = option(
        0.05,
        "fraction of the blocks (with --train-file: of the rows) held out for evaluation, chosen by --seed (0: no "
        "evaluation)",
    )
    streaming: bool = option(
        False, "read, tokenise and pack the text as training goes (text larger than memory); needs --max-steps"
    )
    eval_lines: int = option(
        2000, "with --streaming: the stream's first lines, held out in memory for evaluation (0: none)"
    )
    num_proc: int | None = option(
        None,
        "processes that tokenise the text (default: one per CPU and per 10,000 lines, at most 8)",
        free_on_resume=True,
    )

    def validate(self) -> None:
        super().validate()
        if self.train_file is None and (self.text_files is None) == (self.dataset_name is None):
            raise ConfigError(
                "give the training text with exactly one of --text-files FILES and --dataset-name NAME "
                "(or SFT rows with --train-file FILE)"
            )
        if self.train_file is not None and (self.text_files is not None or self.dataset_name is not None):
            raise ConfigError(
                "give one of --train-file (SFT rows) and --text-files/--dataset-name (text to continue), not both"
            )
        if self.train_file is not None and self.model_name_or_path is None:
            raise ConfigError("--train-file fine-tunes a pretrained model: give it with --model-name-or-path")
        if self.lora_r is not None and self.model_name_or_path is None:
            raise ConfigError("--lora-r adapts a pretrained model: give it with --model-name-or-path")
        if self.eval_file is not None and self.train_file is None:
            raise ConfigError("--eval-file needs --train-file")
        if self.train_file is not None and self.streaming:
            raise ConfigError(
                "--streaming reads --text-files or --dataset-name as a stream; --train-file rows are read into memory"
            )
        if self.packing and self.streaming:
            raise ConfigError("--packing packs rows held in memory: not with --streaming")
        if self.packing and self.group_by_length:
            raise ConfigError("--packing and --group-by-length both cut padding: choose one (--packing leaves less)")
        if self.dataset_config is not None and self.dataset_name is None:
            raise ConfigError("--dataset-config needs --dataset-name")
        if self.block_size is not None:
            require(self.block_size >= 2, "block_size", self.block_size, "an integer >= 2 (one token and the next)")
        require(
            self.vocab_size >= 257, "vocab_size", self.vocab_size, "an integer >= 257 (256 bytes and <|endoftext|>)"
        )
        require(0 <= self.eval_fraction < 1, "eval_fraction", self.eval_fraction, "a fraction in [0, 1)")
        require(0 <= self.dropout < 1, "dropout", self.dropout, "a number in [0, 1)")
        require(self.eval_lines >= 0, "eval_lines", self.eval_lines, "an integer >= 0")
        if self.streaming and self.max_steps is None:
            raise ConfigError(
                "--streaming reads the text as a stream, which has no length to count epochs in: plan the "
                "run with --max-steps N (with --time-budget-minutes, the most it may train)"
            )
        if self.num_proc is not None:
            require(self.num_proc >= 1, "num_proc", self.num_proc, "an integer >= 1")


def main(cfg: CausalLMConfig, task_class: type | None = None) -> dict:
    """``task_class``: a CausalLMTask subclass (the tests count targets with one); default: CausalLMTask."""
    # imported here, not at the top: --help and bad flags answer in a fraction of a second, without torch
    from acceltrain import claim_run_folder, show_progress
    from acceltrain.hf.lora import check_backend
    from acceltrain.text import CausalLMTask, show_progress_bars

    task_class = task_class or CausalLMTask
    # the output folder first: the tokenizer lives there; DeepSpeed is refused before any tokenising
    if cfg.lora_r is not None:
        check_backend(merge=cfg.merge_lora)
    folder = claim_run_folder(cfg, NAME, task=task_class)
    show_progress_bars(show_progress(cfg.progress) and folder.is_main_process)
    with folder.left_as_found():  # bad input leaves nothing behind; a failure once training started keeps everything
        train = _supervised if cfg.train_file is not None else _continued
        return train(folder.cfg, folder, task_class)


def _continued(cfg: CausalLMConfig, folder, task_class) -> dict:
    """Text read, tokenised and packed into blocks: a model trained from scratch, or a pretrained one continued."""
    from acceltrain import build_optimizer, fit
    from acceltrain.text import (
        build_causal_lm,
        expand_text_files,
        flops_per_block,
        held_out_lines,
        load_text,
        save_tokenizer,
        split_blocks,
        streamed_blocks,
        text_fingerprint,
        token_blocks,
        tokenizer_for_run,
    )

    output_dir = folder.output_dir
    texts = load_text(cfg.text_files, cfg.dataset_name, cfg.dataset_config, streaming=cfg.streaming)
    first_lines = texts
    if cfg.streaming:  # its first --eval-lines lines are held out; they (or its first BPE_LINES) train a BPE
        first_lines, rest = held_out_lines(texts, cfg.eval_lines or BPE_LINES)
        texts = rest if cfg.eval_lines else texts
    tokenizer_source, flag = (
        (cfg.tokenizer, "--tokenizer") if cfg.tokenizer else (cfg.model_name_or_path, "--model-name-or-path")
    )
    tokenizer = tokenizer_for_run(
        tokenizer_source, flag, first_lines, output_dir, cfg.vocab_size, resuming=cfg.resume is not None
    )
    if cfg.model_name_or_path:
        model, cfg = _pretrained(cfg, vocab_size=len(tokenizer))
    else:
        cfg = dataclasses.replace(cfg, block_size=cfg.block_size or BLOCK_SIZE)
        model = build_causal_lm(
            cfg.model,
            vocab_size=len(tokenizer),
            block_size=cfg.block_size,
            dropout=cfg.dropout,
            end_of_text_id=tokenizer.eos_token_id,
        )
    if cfg.streaming:
        train_set = streamed_blocks(texts, tokenizer, block_size=cfg.block_size, seed=cfg.seed)
        eval_set = (
            token_blocks(first_lines, tokenizer, block_size=cfg.block_size).with_format("torch")
            if cfg.eval_lines
            else None
        )
    elif cfg.packing:
        from acceltrain.text.packing import packed_documents

        train_set, eval_set = packed_documents(
            texts,
            tokenizer,
            block_size=cfg.block_size,
            eval_fraction=cfg.eval_fraction,
            seed=cfg.seed,
            num_proc=cfg.num_proc,
        )
    else:
        blocks = token_blocks(texts, tokenizer, block_size=cfg.block_size, num_proc=cfg.num_proc)
        train_set, eval_set = split_blocks(blocks, eval_fraction=cfg.eval_fraction, seed=cfg.seed)
    if cfg.text_files:  # a resume refuses text that changed since (a Hub dataset has no fingerprint here)
        train_set.fingerprint = text_fingerprint(expand_text_files(cfg.text_files))
    tokens = train_set.mean_tokens if cfg.packing else cfg.block_size
    task = task_class(tokens, flops_per_block(model, tokens))
    if folder.is_main_process:  # before training: the run folder loads with from_pretrained, tokenizer included
        save_tokenizer(tokenizer, output_dir)
    hooks, collate_fn = _packing(cfg, model, tokenizer, task)
    return fit(
        cfg,
        model,
        build_optimizer(model, cfg),
        train_set,
        eval_set,
        task=task,
        name=NAME,
        hooks=hooks,
        collate_fn=collate_fn,
    )


def _supervised(cfg: CausalLMConfig, folder, task_class) -> dict:
    """SFT: prompt/response (or conversation) rows, the loss on response tokens only, one example per sequence,
    padded per batch; with --packing, several examples per row (:mod:`acceltrain.text.packing`)."""
    from acceltrain import build_optimizer, fit
    from acceltrain.text import (
        DataReport,
        LengthGrouped,
        check_columns,
        file_fingerprint,
        first_epoch_padding,
        flops_per_block,
        hold_out,
        load_rows,
        pretrained_tokenizer,
        save_tokenizer,
        sft_batches,
        sft_examples,
        sft_kept,
    )

    train_rows, eval_rows, train_where, eval_where = load_rows(cfg.train_file, cfg.eval_file, None, None)
    chat = cfg.messages_column in train_rows.column_names
    columns = (
        {"messages_column": cfg.messages_column}
        if chat
        else {"prompt_column": cfg.prompt_column, "response_column": cfg.response_column}
    )
    for rows, where in ((train_rows, train_where), (eval_rows, eval_where)):
        if rows is not None:
            check_columns(rows, where, **columns)
    tokenizer = pretrained_tokenizer(cfg.tokenizer, cfg.model_name_or_path)
    model, cfg = _pretrained(cfg, vocab_size=len(tokenizer))
    encoding = {
        "block_size": cfg.block_size,
        "prompt": cfg.prompt_column,
        "response": cfg.response_column,
        "messages": cfg.messages_column if chat else None,
        "num_proc": cfg.num_proc,
    }
    train_set = sft_examples(train_rows, tokenizer, where=train_where, **encoding)
    if eval_rows is None:
        train_set, eval_set = hold_out(train_set, cfg.eval_fraction, cfg.seed)
        eval_where = f"the --eval-fraction {cfg.eval_fraction} of {train_where}"
    else:
        eval_set = sft_examples(eval_rows, tokenizer, where=eval_where, **encoding)
    train_set, lengths, train_counts = sft_kept(train_set, block_size=cfg.block_size, where=train_where)
    eval_set, eval_lengths, eval_counts = (
        sft_kept(eval_set, block_size=cfg.block_size, where=eval_where)
        if eval_set is not None
        else (None, None, {"truncated": 0, "dropped": 0})
    )
    train_set.fingerprint = file_fingerprint(cfg.train_file, cfg.eval_file)  # a resume refuses rows that changed since
    if cfg.packing:
        from acceltrain.text.packing import PackedRows

        train_set = PackedRows(train_set, lengths, cfg.block_size)
        eval_set = PackedRows(eval_set, eval_lengths, cfg.block_size) if eval_set is not None else None
        lengths = train_set.lengths  # a row's real tokens
    if cfg.group_by_length:
        train_set = LengthGrouped(train_set, lengths, batch_size=cfg.batch_size, seed=cfg.seed)
    tokens = sum(lengths) / len(lengths)  # an example's mean, padding left out
    task = task_class(tokens, flops_per_block(model, tokens))
    report = DataReport(
        {
            "truncated_examples": {"train": train_counts["truncated"], "eval": eval_counts["truncated"]},
            "dropped_examples": {"train": train_counts["dropped"], "eval": eval_counts["dropped"]},
            "padded_token_fraction": first_epoch_padding(train_set, lengths, batch_size=cfg.batch_size, seed=cfg.seed),
        }
    )
    if folder.is_main_process:  # before training: the run folder loads with from_pretrained, tokenizer included
        save_tokenizer(tokenizer, folder.output_dir)
    hooks, collate_fn = _packing(cfg, model, tokenizer, task) if cfg.packing else ([], sft_batches(tokenizer))
    return fit(
        cfg,
        model,
        build_optimizer(model, cfg),
        train_set,
        eval_set,
        task=task,
        name=NAME,
        hooks=[report, *hooks],
        collate_fn=collate_fn,
    )


def _packing(cfg: CausalLMConfig, model, tokenizer, task) -> tuple[list, object]:
    """With --packing: (the check that the model takes packed rows exactly, the packed rows' collate function);
    without: no hook, the loop's own collation."""
    if not cfg.packing:
        return [], None
    from acceltrain.text.packing import PackedBatches, PackingCheck, flash_attention

    pad = next(token for token in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if token is not None)
    collate_fn = PackedBatches(pad, flash_attention=flash_attention(model))
    return [PackingCheck(task, collate_fn, len(tokenizer))], collate_fn


def _pretrained(cfg: CausalLMConfig, *, vocab_size: int) -> tuple:
    """(the --model-name-or-path model, with a LoRA adapter when --lora-r asks for one; ``cfg`` with its block size:
    unset, the default cut to the model's positions)."""
    from acceltrain import apply_lora
    from acceltrain.text import fitting_length, load_causal_lm

    model, missing = load_causal_lm(cfg.model_name_or_path, vocab_size=vocab_size, block_size=None)
    block_size = fitting_length(cfg.block_size, BLOCK_SIZE, "--block-size", model, cfg.model_name_or_path)
    cfg = dataclasses.replace(cfg, block_size=block_size)
    return (apply_lora(model, cfg, missing_keys=missing) if cfg.lora_r is not None else model), cfg


def cli() -> None:
    """The command line (console script, ``python -m``, ``accelerate launch``); returns nothing, so that the
    console script's ``sys.exit(cli())`` exits 0."""
    run_recipe(main, CausalLMConfig, description=__doc__)


if __name__ == "__main__":
    cli()
