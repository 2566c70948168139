"""The causal-LM recipe on generated text: outputs, token-normalised loss under accumulation and on 2
processes (uneven target counts), exact resume, tokenizer training and reuse, one-line errors. Offline:
the Hub is switched off and the datasets cache lives in a temporary folder."""

from __future__ import annotations

import contextlib
import math
import os
import random
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, check, launch, read_events, read_summary, reset_accelerate_state
from safetensors.torch import load_file

from acceltrain import ConfigError, parse_config, run_recipe
from acceltrain.runtime.preemption import EXIT_PREEMPTED

sys.path.insert(0, str(REPO / "recipes"))
sys.path.insert(0, str(REPO / "tests" / "helpers"))
import causal_lm  # noqa: E402
import uneven_causal_lm  # noqa: E402

from acceltrain.text import (  # noqa: E402  # noqa: E402
    TOKENIZER_FILE,
    CausalLMTask,
    build_causal_lm,
    flops_per_block,
    matmul_parameters,
    split_blocks,
)

UNEVEN_RECIPE = REPO / "tests" / "helpers" / "uneven_causal_lm.py"
WORDS = (
    "king queen lord lady sword crown night day love war speak hear good ill heart blood fair foul "
    "come go thou thee thy shall will not what why when now then here there death life"
).split()
# gpt2-tiny on 32-token blocks of a 300-token BPE: a few milliseconds a step
SMALL = [
    "--model",
    "gpt2-tiny",
    "--vocab-size",
    "300",
    "--block-size",
    "32",
    "--eval-fraction",
    "0.1",
    "--num-proc",
    "1",
    "--num-workers",
    "0",
    "--no-progress",
    "--report-to",
    "none",
    "--log-every",
    "1",
]
# plain SGD and no clipping: the update is the gradient itself, so any mis-weighted token shows
EXACT = [*SMALL, "--optimizer", "sgd", "--lr", "0.5", "--momentum", "0", "--max-grad-norm", "none", "--max-steps", "4"]


def write_text(path: Path, lines: int = 600, seed: int = 0) -> Path:
    rng = random.Random(seed)
    path.write_text(
        "".join(
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12))).capitalize() + ".\n" for _ in range(lines)
        )
    )
    return path


@contextlib.contextmanager
def offline_on_one_thread(root: Path):
    """No downloads and no ~/.cache: the environment for subprocesses, and the module constants too,
    because datasets and huggingface_hub read the environment once, when first imported. One torch
    thread, like the launched processes (conftest: OMP_NUM_THREADS=1): these models are too small for a
    second one to help, and on a busy machine it only waits."""
    import datasets.config
    import huggingface_hub.constants

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HOME", str(root / "home"))
        patch.setenv("HF_DATASETS_CACHE", str(root / "datasets"))
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", root / "datasets")
        patch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        try:
            yield
        finally:
            torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf")


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    return write_text(tmp_path_factory.mktemp("text") / "plays.txt")


@pytest.fixture(autouse=True)
def offline(hf_root):
    with offline_on_one_thread(hf_root):
        yield


def run(main, output_dir: Path, *args: str) -> int:
    """One in-process run of the recipe; its exit code (0, 75 when it stopped early, 2 on bad input)."""
    reset_accelerate_state()
    try:
        run_recipe(main, causal_lm.CausalLMConfig, ["--output-dir", str(output_dir), *args])
    except SystemExit as stop:
        return stop.code
    return 0


def weights(output_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(output_dir / "model.safetensors"))


def assert_same_weights(got: Path, expected: Path) -> None:
    reference = weights(expected)
    for key, value in weights(got).items():
        torch.testing.assert_close(value, reference[key], rtol=1e-4, atol=1e-6, msg=key)


@pytest.fixture(scope="module")
def big_batch(tmp_path_factory, hf_root, text_file) -> Path:
    """Uneven targets, one process, batch 8, no accumulation: what the other layouts must reproduce."""
    out = tmp_path_factory.mktemp("big") / "run"
    with offline_on_one_thread(hf_root):
        assert run(uneven_causal_lm.main, out, *EXACT, "--text-files", str(text_file), "--batch-size", "8") == 0
    reset_accelerate_state()
    return out


def test_trains_and_writes_summary_metrics_weights_and_a_loadable_folder(tmp_path, text_file):
    out = tmp_path / "run"
    assert (
        run(
            causal_lm.main,
            out,
            *SMALL,
            "--text-files",
            str(text_file),
            "--batch-size",
            "8",
            "--max-steps",
            "6",
            "--eval-every",
            "3",
        )
        == 0
    )
    summary = read_summary(out)
    evals = [e for e in read_events(out) if "eval_loss" in e]
    assert [e["step"] for e in evals] == [3, 6]
    assert evals[-1]["eval_perplexity"] == pytest.approx(math.exp(evals[-1]["eval_loss"]))
    assert (
        summary["eval_loss"] == pytest.approx(evals[-1]["eval_loss"]) and summary["eval_loss"] < evals[0]["eval_loss"]
    )
    assert summary["eval_perplexity"] == pytest.approx(evals[-1]["eval_perplexity"])
    assert summary["eval_loss"] < math.log(300), "better than uniform over the vocabulary"
    assert summary["steps"] == 6 and summary["samples_seen"] == 48
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == model.config.vocab_size == 300 and tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.decode(tokenizer("Good night, sweet lord.\n")["input_ids"]) == "Good night, sweet lord.\n"
    torch.testing.assert_close(
        model.transformer.h[0].attn.c_attn.weight, weights(out)["transformer.h.0.attn.c_attn.weight"]
    )


def test_blocks_are_fixed_length_tensors_and_the_split_is_seeded(tmp_path, text_file):
    from acceltrain.text import load_text, token_blocks, tokenizer_for_run

    texts = load_text(str(text_file))
    tokenizer = tokenizer_for_run(None, "--tokenizer", texts, tmp_path, 300)
    blocks = token_blocks(texts, tokenizer, block_size=32, num_proc=1)
    train, held_out = split_blocks(blocks, eval_fraction=0.1, seed=0)
    item = train[0]
    assert set(item) == {"input_ids"} and item["input_ids"].dtype == torch.long and item["input_ids"].shape == (32,)
    assert len(held_out) == round(0.1 * len(blocks)) and len(train) + len(held_out) == len(blocks)
    rows = lambda dataset: {tuple(row.tolist()) for row in dataset["input_ids"]}  # noqa: E731
    assert not rows(train) & rows(held_out)
    again, other_seed = (
        split_blocks(blocks, eval_fraction=0.1, seed=0)[1],
        split_blocks(blocks, eval_fraction=0.1, seed=1)[1],
    )
    assert rows(again) == rows(held_out) != rows(other_seed)
    in_parallel = token_blocks(texts, tokenizer, block_size=32, num_proc=2)
    assert torch.equal(torch.as_tensor(in_parallel[:]["input_ids"]), torch.as_tensor(blocks[:]["input_ids"])), (
        "num_proc changes nothing"
    )


def test_grad_accumulation_matches_the_big_batch_with_uneven_targets(tmp_path, big_batch, text_file):
    out = tmp_path / "accum"
    assert (
        run(
            uneven_causal_lm.main, out, *EXACT, "--text-files", str(text_file), "--batch-size", "2", "--grad-accum", "4"
        )
        == 0
    )
    assert_same_weights(out, big_batch)
    assert read_summary(out)["train_loss"] == pytest.approx(read_summary(big_batch)["train_loss"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_match_one_process_with_uneven_targets(tmp_path, big_batch, text_file, hf_root):
    out = tmp_path / "ddp"
    result = check(
        launch(
            UNEVEN_RECIPE,
            [*EXACT, "--text-files", str(text_file), "--batch-size", "4", "--output-dir", str(out)],
            processes=2,
            launcher="accelerate",
            HF_HOME=str(hf_root / "home"),
            HF_DATASETS_CACHE=str(hf_root / "datasets"),
            HF_HUB_OFFLINE="1",
        )
    )
    assert read_summary(out)["num_processes"] == 2 and result.stdout.count("trained a byte-level BPE") == 1
    assert_same_weights(out, big_batch)


@pytest.mark.slow
def test_resume_is_byte_identical_and_reuses_the_tokenizer(tmp_path, text_file, capsys):
    """With dropout: the resumed launch's loader once drew its base seed from the restored global generator, which
    shifted every later dropout mask (the loaders have their own generators now)."""
    args = [
        *SMALL,
        "--text-files",
        str(text_file),
        "--batch-size",
        "4",
        "--grad-accum",
        "2",
        "--max-steps",
        "6",
        "--eval-every",
        "2",
        "--dropout",
        "0.1",
    ]
    full, part = tmp_path / "full", tmp_path / "part"
    assert run(causal_lm.main, full, *args) == 0
    assert run(causal_lm.main, part, *args, "--stop-after-steps", "3") == EXIT_PREEMPTED
    tokenizer_file = part / TOKENIZER_FILE
    trained = tokenizer_file.read_bytes()
    capsys.readouterr()
    assert run(causal_lm.main, part, *args, "--resume", "auto", "--vocab-size", "500") == 2
    assert "vocab_size 300 -> 500" in capsys.readouterr().err, (
        "a setting the resume would ignore is refused, not dropped"
    )
    assert run(causal_lm.main, part, *args, "--resume", "auto") == 0
    assert "tokenizer: reusing" in capsys.readouterr().out
    assert tokenizer_file.read_bytes() == trained, "reused, not retrained"
    assert (part / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()
    assert [e["step"] for e in read_events(part) if "loss" in e] == list(range(1, 7))


@pytest.mark.slow
def test_a_new_run_in_an_old_folder_trains_its_own_tokenizer(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    args = [*SMALL, "--text-files", str(text_file), "--batch-size", "4", "--max-steps", "1"]
    assert run(causal_lm.main, out, *args) == 0
    capsys.readouterr()
    assert run(causal_lm.main, out, *args, "--overwrite", "--vocab-size", "280") == 0
    assert "tokenizer: trained a byte-level BPE of 280 tokens" in capsys.readouterr().out
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(out)) == 280, "not the earlier run's 300-token vocabulary"


def test_continues_training_a_local_pretrained_folder_with_its_tokenizer(tmp_path, big_batch, text_file):
    out = tmp_path / "finetune"
    assert (
        run(
            causal_lm.main,
            out,
            *SMALL,
            "--text-files",
            str(text_file),
            "--model-name-or-path",
            str(big_batch),
            "--batch-size",
            "4",
            "--max-steps",
            "2",
        )
        == 0
    )
    assert (out / TOKENIZER_FILE).read_bytes() == (big_batch / TOKENIZER_FILE).read_bytes(), (
        "the model folder's tokenizer, kept"
    )
    assert read_summary(out)["eval_loss"] is not None


def test_without_block_size_a_pretrained_model_trains_at_its_limit_one_given_is_checked(tmp_path, text_file, capsys):
    """Round 5 (issue 38, item 12): the default --block-size (256) was refused on a model of 128 positions, as if the
    user had asked for it; only a block size given is refused now (run_clm's min(default, model limit))."""
    sys.path.insert(0, str(REPO / "tests" / "helpers"))
    from pretrained_folders import causal_lm_folder

    model = causal_lm_folder(tmp_path / "short", positions=128)
    args = [
        "--text-files",
        str(text_file),
        "--model-name-or-path",
        str(model),
        "--num-proc",
        "1",
        "--num-workers",
        "0",
        "--no-progress",
        "--report-to",
        "none",
        "--batch-size",
        "2",
        "--max-steps",
        "1",
    ]
    assert run(causal_lm.main, tmp_path / "unsized", *args) == 0
    assert read_summary(tmp_path / "unsized")["config"]["block_size"] == 128
    logged = f"--block-size 128: the positions of --model-name-or-path {str(model)!r} (the default, 256, is longer)"
    assert logged in capsys.readouterr().out
    assert run(causal_lm.main, tmp_path / "sized", *args, "--block-size", "256") == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --block-size 256 is longer than --model-name-or-path {str(model)!r} supports (128 positions)"
    assert not (tmp_path / "sized").exists()


def test_llama_preset_and_flop_count():
    model = build_causal_lm("llama-tiny", vocab_size=300, block_size=32)
    layers, width = model.config.num_hidden_layers, model.config.hidden_size
    non_embedding = sum(p.numel() for p in model.parameters()) - 300 * width  # tied: the output projection stays
    assert matmul_parameters(model) == non_embedding + 300 * width
    assert flops_per_block(model, 32) == 6 * matmul_parameters(model) * 32 + 12 * layers * width * 32**2
    task = CausalLMTask(32, flops_per_block(model, 32))
    batch = {"input_ids": torch.randint(0, 300, (2, 32))}
    loss_sum, count = task.train_loss(model, batch)
    assert count.item() == 2 * 31 and loss_sum.item() / 31 / 2 == pytest.approx(math.log(300), rel=0.1)
    values = task.eval_values(model, batch)
    assert values["tokens"].tolist() == [31.0, 31.0]
    assert task.eval_metrics({"loss_sum": 62 * 2.0, "tokens": 62.0}, 2) == {
        "loss": 2.0,
        "perplexity": pytest.approx(math.exp(2)),
    }
    assert (task.tokens_per_sample, task.primary_metric, task.higher_is_better) == (32, "loss", False)


@pytest.mark.parametrize("preset", ["lm_tiny_cpu.yaml", "lm_gpt2_124m_gpu.yaml"])
def test_presets_are_valid(preset, text_file):
    cfg = parse_config(
        causal_lm.CausalLMConfig,
        ["--config", str(REPO / "recipes" / "configs" / preset), "--text-files", str(text_file)],
    )
    assert cfg.optimizer == "adamw" and cfg.lr < 0.01


BAD_INPUTS = [
    (["--text-files", "{tmp}/nothing/*.txt"], "matches no file"),
    (["--text-files", "{tmp}/empty.txt"], "the files are empty"),
    (["--text-files", "{tmp}/fifo"], "fifo' is a named pipe (FIFO), not a regular file"),  # was "the files are empty"
    (["--text-files", "{text}", "--block-size", "100000"], "--block-size 100000 is too long for the text"),
    (
        ["--text-files", "{text}", "--eval-fraction", "0.99", "--block-size", "512"],
        "--eval-fraction 0.99 leaves no training data",
    ),
    ([], "exactly one of --text-files FILES and --dataset-name NAME"),
    (["--dataset-name", "Salesforce/wikitext"], "--dataset-name 'Salesforce/wikitext' could not be loaded"),
    (
        ["--text-files", "{text}", "--tokenizer", "openai-community/gpt2"],
        "--tokenizer 'openai-community/gpt2': could not load",
    ),
    (["--text-files", "{text}", "--tokenizer", "{tmp}/missing"], "no such file or folder"),
    (
        ["--text-files", "{text}", "--model-name-or-path", "openai-community/gpt2"],
        "--model-name-or-path 'openai-community/gpt2'",
    ),
    (["--text-files", "{text}", "--vocab-size", "100"], "--vocab-size 100 is invalid"),
    (
        ["--text-files", "{text}", "--target-accuracy", "0.5"],
        "--target-accuracy 0.5 needs a task whose primary metric is accuracy; CausalLMTask's is 'loss'",
    ),
    (["--text-files", "{text}", "--data-on-device"], "--data-on-device needs a dataset with a device_loader() method"),
]


@pytest.mark.parametrize(
    "argv,message", BAD_INPUTS, ids=[m.split()[0] + "-" + str(i) for i, (_, m) in enumerate(BAD_INPUTS)]
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, text_file, capsys, argv, message):
    (tmp_path / "empty.txt").write_text("")
    os.mkfifo(tmp_path / "fifo")
    out = tmp_path / "out"
    argv = [arg.format(tmp=tmp_path, text=text_file) for arg in argv]
    assert run(causal_lm.main, out, *SMALL, *argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and message in err, err
    assert not out.exists(), "bad input must not write anything (the tokenizer included)"


@pytest.mark.slow
def test_deepspeed_is_refused_before_any_work(tmp_path, text_file, hf_root):
    pytest.importorskip("deepspeed")
    out = tmp_path / "ds"
    result = launch(
        REPO / "recipes" / "causal_lm.py",
        [*SMALL, "--text-files", str(text_file), "--output-dir", str(out)],
        launcher="accelerate",
        config="deepspeed_zero2.yaml",
        HF_HOME=str(hf_root / "home"),
        HF_HUB_OFFLINE="1",
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and len(errors) == 1 and "DeepSpeed keeps them in its partitions" in errors[0], (
        result.stderr[-2000:]
    )
    assert not out.exists() and "tokenizer:" not in result.stdout


def test_defaults_suit_a_language_model_and_dataset_config_needs_a_dataset():
    cfg = parse_config(causal_lm.CausalLMConfig, ["--text-files", "x"])
    assert (cfg.optimizer, cfg.lr, cfg.max_grad_norm) == ("adamw", 6e-4, 1.0)
    with pytest.raises(ConfigError, match="--dataset-config needs --dataset-name"):
        parse_config(causal_lm.CausalLMConfig, ["--text-files", "x", "--dataset-config", "y"])


@pytest.mark.slow
def test_activation_checkpointing_and_bf16_run_through_the_model_s_own_hooks(tmp_path, text_file):
    """The speed flags reach the LM too: activation checkpointing through the model's own
    ``activation_checkpointing_enable`` trains to the same weights; bf16 autocast runs and is recorded."""
    args = [*EXACT, "--text-files", str(text_file), "--batch-size", "4", "--max-steps", "2"]
    plain, checkpointed, bf16 = tmp_path / "plain", tmp_path / "checkpointed", tmp_path / "bf16"
    assert run(causal_lm.main, plain, *args) == 0
    assert run(causal_lm.main, checkpointed, *args, "--activation-checkpointing") == 0
    assert_same_weights(checkpointed, plain)
    assert read_summary(checkpointed)["config"]["activation_checkpointing"] is True
    assert run(causal_lm.main, bf16, *args, "--mixed-precision", "bf16") == 0
    assert read_summary(bf16)["mixed_precision"] == "bf16"


def test_streamed_blocks_are_the_in_memory_blocks(text_file):
    """--streaming tokenises and packs on the fly as the in-memory path does: the same blocks, in the same
    order when not shuffled (a buffer of one block)."""
    import datasets

    from acceltrain.text import load_text, streamed_blocks, token_blocks, tokenizer_for_run

    texts = load_text(str(text_file))
    tokenizer = tokenizer_for_run(None, "--tokenizer", texts, text_file.parent / "tok", 300)
    in_memory = torch.stack(
        [row["input_ids"] for row in token_blocks(texts, tokenizer, block_size=32, num_proc=1).with_format("torch")]
    )
    stream = load_text(str(text_file), streaming=True)
    assert isinstance(stream, datasets.IterableDataset)
    streamed = torch.stack(
        [row["input_ids"] for row in streamed_blocks(stream, tokenizer, block_size=32, seed=0, shuffle_buffer=1)]
    )
    assert torch.equal(streamed, in_memory)


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["0", "1"])
def test_streaming_resumes_byte_identically_across_passes(tmp_path, workers):
    """60 lines, 10 held out for evaluation: a pass is a few steps, so the run crosses passes' ends."""
    text = write_text(tmp_path / "short.txt", lines=60, seed=1)
    args = [
        *SMALL,
        "--num-workers",
        workers,
        "--text-files",
        str(text),
        "--streaming",
        "--eval-lines",
        "10",
        "--batch-size",
        "4",
        "--grad-accum",
        "2",
        "--max-steps",
        "8",
        "--eval-every",
        "4",
    ]
    full, part = tmp_path / "full", tmp_path / "part"
    assert run(causal_lm.main, full, *args) == 0
    summary = read_summary(full)
    assert summary["epochs"] >= 2, "the run crossed passes"
    assert summary["eval_loss"] is not None
    assert run(causal_lm.main, part, *args, "--stop-after-steps", "5") == EXIT_PREEMPTED
    assert run(causal_lm.main, part, *args, "--resume", "auto") == 0
    assert (part / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_a_resume_refuses_text_that_changed_since_the_checkpoint(tmp_path, capsys):
    """Round 4 (issue 31, items 5 and 11): text replaced by other text of the same size resumed silently (stream and
    held-out lines both changed), and text that shrank failed deep in the loader; the text's fingerprint is recorded
    in each checkpoint and compared."""
    text = write_text(tmp_path / "short.txt", lines=60, seed=1)
    args = [
        *SMALL,
        "--text-files",
        str(text),
        "--streaming",
        "--eval-lines",
        "10",
        "--batch-size",
        "4",
        "--max-steps",
        "8",
    ]
    part = tmp_path / "part"
    assert run(causal_lm.main, part, *args, "--stop-after-steps", "5") == EXIT_PREEMPTED
    original = text.read_text()
    lines = original.splitlines(keepends=True)
    for changed in (
        "".join(reversed(lines)),
        "".join(lines[:20]),
    ):  # the same size; shorter than the checkpoint's place
        text.write_text(changed)
        capsys.readouterr()
        assert run(causal_lm.main, part, *args, "--resume", "auto") == 2
        err = capsys.readouterr().err.strip()
        assert (
            "was trained on data whose fingerprint is" in err and "its content changed since" in err and "\n" not in err
        ), err
    text.write_text(original)
    assert run(causal_lm.main, part, *args, "--resume", "auto") == 0


def test_streaming_without_max_steps_is_one_line(tmp_path, text_file, capsys):
    assert run(causal_lm.main, tmp_path / "run", *SMALL, "--text-files", str(text_file), "--streaming") == 2
    err = capsys.readouterr().err.strip()
    assert "--streaming reads the text as a stream" in err and "--max-steps N" in err and "\n" not in err
