"""A causal language model (GPT-2 or Llama style, Transformers) on local text with the acceltrain loop.

    acceltrain-causal-lm --config lm_tiny_cpu --text-files ../shared/datasets/tinyshakespeare.txt
    accelerate launch --config_file accelerate_configs/single_gpu.yaml -m acceltrain.recipes.causal_lm \\
        --config lm_gpt2_124m_gpu --text-files 'corpus/*.txt'

Without --tokenizer a byte-level BPE is trained on the text and kept as <output-dir>/tokenizer.json
(reused on --resume). The output folder (weights, config, tokenizer) loads with
AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained.
Every flag: acceltrain-causal-lm --help (or python recipes/causal_lm.py --help in a checkout)
"""

import dataclasses
from dataclasses import dataclass

from acceltrain import ConfigError, TrainConfig, option, require, run_recipe
from acceltrain.config import Optimizer
from acceltrain.text import MODEL_PRESETS

__all__ = ["CausalLMConfig", "cli", "main"]

NAME = "causal_lm"
BPE_LINES = 2000  # with --streaming --eval-lines 0: the stream's first lines that train a BPE (not held out)


def lm_default(name: str, value):
    """TrainConfig's field ``name`` (same flag, same help) with a default that suits a language model."""
    parent = {field.name: field for field in dataclasses.fields(TrainConfig)}[name]
    return option(value, **parent.metadata)


@dataclass
class CausalLMConfig(TrainConfig):
    # the loop's defaults suit CIFAR; these suit a transformer (GPT-2 recipes)
    batch_size: int = lm_default("batch_size", 16)
    optimizer: Optimizer = lm_default("optimizer", "adamw")
    lr: float = lm_default("lr", 6e-4)
    weight_decay: float = lm_default("weight_decay", 0.1)
    max_grad_norm: float | None = lm_default("max_grad_norm", 1.0)
    # model
    model: str = option("gpt2-tiny", "architecture-size of a freshly initialised model", choices=MODEL_PRESETS)
    model_name_or_path: str | None = option(None, "start from this pretrained model instead (local folder; Hub name when online)")
    dropout: float = option(0.0, "dropout of a --model preset (GPT-2: embeddings, residuals, attention; Llama: attention)")
    # data
    text_files: str | None = option(
        None, "comma-separated text files or globs ('data/*.txt'), read line by line (a list in YAML)", list_like=True
    )
    dataset_name: str | None = option(None, "Hub dataset with a 'text' column, instead of --text-files (online only)")
    dataset_config: str | None = option(None, "configuration of --dataset-name (e.g. wikitext-103-raw-v1)")
    tokenizer: str | None = option(
        None, "tokenizer.json, tokenizer folder or Hub name; default: the --model-name-or-path folder's, else a BPE trained on the text"
    )
    vocab_size: int = option(8192, "vocabulary of the BPE trained when there is no --tokenizer")
    block_size: int = option(256, "tokens per training sequence (context length)")
    eval_fraction: float = option(0.05, "fraction of the blocks held out for evaluation, chosen by --seed (0: no evaluation)")
    streaming: bool = option(False, "read, tokenise and pack the text as training goes (text larger than memory); needs --max-steps")
    eval_lines: int = option(2000, "with --streaming: the stream's first lines, held out in memory for evaluation (0: none)")
    num_proc: int | None = option(
        None, "processes that tokenise the text (default: one per CPU and per 10,000 lines, at most 8)", free_on_resume=True
    )

    def validate(self) -> None:
        super().validate()
        if (self.text_files is None) == (self.dataset_name is None):
            raise ConfigError("give the training text with exactly one of --text-files FILES and --dataset-name NAME")
        if self.dataset_config is not None and self.dataset_name is None:
            raise ConfigError("--dataset-config needs --dataset-name")
        require(self.block_size >= 2, "block_size", self.block_size, "an integer >= 2 (one token and the next)")
        require(self.vocab_size >= 257, "vocab_size", self.vocab_size, "an integer >= 257 (256 bytes and <|endoftext|>)")
        require(0 <= self.eval_fraction < 1, "eval_fraction", self.eval_fraction, "a fraction in [0, 1)")
        require(0 <= self.dropout < 1, "dropout", self.dropout, "a number in [0, 1)")
        require(self.eval_lines >= 0, "eval_lines", self.eval_lines, "an integer >= 0")
        if self.streaming and self.max_steps is None:
            raise ConfigError("--streaming reads the text as a stream, which has no length to count epochs in: plan the "
                              "run with --max-steps N (with --time-budget-minutes, the most it may train)")
        if self.num_proc is not None:
            require(self.num_proc >= 1, "num_proc", self.num_proc, "an integer >= 1")


def main(cfg: CausalLMConfig, task_class: type | None = None) -> dict:
    """``task_class``: a CausalLMTask subclass (the tests count targets with one); default: CausalLMTask."""
    # imported here, not at the top: --help and bad flags answer in a fraction of a second, without torch
    from acceltrain import build_optimizer, fit, on_main_process_first, setup_run, show_progress
    from acceltrain.text import (
        CausalLMTask,
        build_causal_lm,
        expand_text_files,
        flops_per_block,
        held_out_lines,
        load_causal_lm,
        load_text,
        removed_on_bad_input,
        save_tokenizer,
        show_progress_bars,
        split_blocks,
        streamed_blocks,
        text_fingerprint,
        token_blocks,
        tokenizer_for_run,
    )

    task_class = task_class or CausalLMTask
    # the output folder first: the tokenizer lives there; DeepSpeed is refused before any tokenising
    run = setup_run(cfg, NAME, task=task_class)
    cfg, output_dir = run.cfg, run.output_dir
    show_progress_bars(show_progress(cfg.progress) and run.is_main_process)
    with removed_on_bad_input(output_dir):
        texts = load_text(cfg.text_files, cfg.dataset_name, cfg.dataset_config, streaming=cfg.streaming)
        first_lines = texts
        if cfg.streaming:  # its first --eval-lines lines are held out; they (or its first BPE_LINES) train a BPE
            first_lines, rest = held_out_lines(texts, cfg.eval_lines or BPE_LINES)
            texts = rest if cfg.eval_lines else texts
        tokenizer_source, flag = (cfg.tokenizer, "--tokenizer") if cfg.tokenizer else (cfg.model_name_or_path, "--model-name-or-path")
        tokenizer = tokenizer_for_run(tokenizer_source, flag, first_lines, output_dir, cfg.vocab_size, resuming=cfg.resume is not None)
        if cfg.streaming:
            train_set = streamed_blocks(texts, tokenizer, block_size=cfg.block_size, seed=cfg.seed)
            eval_set = token_blocks(first_lines, tokenizer, block_size=cfg.block_size).with_format("torch") if cfg.eval_lines else None
        else:
            blocks = token_blocks(texts, tokenizer, block_size=cfg.block_size, num_proc=cfg.num_proc)
            train_set, eval_set = split_blocks(blocks, eval_fraction=cfg.eval_fraction, seed=cfg.seed)
        if cfg.text_files:  # a resume refuses text that changed since (a Hub dataset has no fingerprint here)
            train_set.fingerprint = text_fingerprint(expand_text_files(cfg.text_files))
        shape = {"vocab_size": len(tokenizer), "block_size": cfg.block_size}
        if cfg.model_name_or_path:
            model = on_main_process_first(lambda: load_causal_lm(cfg.model_name_or_path, **shape))
        else:
            model = build_causal_lm(cfg.model, **shape, dropout=cfg.dropout, end_of_text_id=tokenizer.eos_token_id)
        task = task_class(cfg.block_size, flops_per_block(model, cfg.block_size))
        if run.is_main_process:  # before training: the run folder loads with from_pretrained, tokenizer included
            save_tokenizer(tokenizer, output_dir)
        return fit(cfg, model, build_optimizer(model, cfg), train_set, eval_set, task=task, name=NAME)


def cli() -> None:
    """The command line (console script, ``python -m``, ``accelerate launch``); returns nothing, so that the
    console script's ``sys.exit(cli())`` exits 0."""
    run_recipe(main, CausalLMConfig, description=__doc__)


if __name__ == "__main__":
    cli()
