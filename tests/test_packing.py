"""``--packing`` (issue 46 part 1): best-fit-decreasing rows, the collator's labels and position ids, packed logits
equal to each example run alone (SDPA and eager), the one-line refusal of a model that would mix examples, the eval
loss of packed rows equal to the unpacked one, a packed SFT run that resumes byte-identically, and the real-tokens
figures of packed and unpacked runs. Tiny models made here, offline, one thread."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, check, launch, read_events, read_summary
from test_causal_lm import assert_same_weights, offline_on_one_thread
from torch import nn

from acceltrain import ConfigError
from acceltrain.runtime.preemption import EXIT_PREEMPTED
from acceltrain.text import IGNORE_INDEX, CausalLMTask, sft_batches, sft_examples, sft_kept
from acceltrain.text.packing import (
    PackedBatches,
    PackedRows,
    best_fit_decreasing,
    check_packable,
    document_pieces,
)

sys.path.insert(0, str(REPO / "recipes"))
sys.path.insert(0, str(REPO / "tests" / "helpers"))
import causal_lm  # noqa: E402
from in_process import run_in_process  # noqa: E402
from pretrained_folders import causal_lm_folder, instructions, write_rows  # noqa: E402

QUIET = ["--num-workers", "0", "--num-proc", "1", "--no-progress", "--report-to", "none", "--no-plots"]


def run(output_dir, *args: str) -> int:
    return run_in_process(causal_lm.main, causal_lm.CausalLMConfig, output_dir, *args)


def skewed(count: int, seed: int = 0) -> list[dict]:
    """Instruction rows, every fourth one with a long prompt: lengths skewed as real SFT files are."""
    rows = instructions(count, seed)
    for index in range(0, count, 4):
        rows[index]["prompt"] = "good " * 30 + rows[index]["prompt"]
    return rows


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("packing")
    with offline_on_one_thread(root / "hf"):
        llama = causal_lm_folder(root / "llama", arch="llama", chat_template=True)
    return SimpleNamespace(root=root, llama=llama, rows=write_rows(root / "sft.jsonl", skewed(48)))


@pytest.fixture(autouse=True)
def offline(data):
    with offline_on_one_thread(data.root / "hf"):
        yield


def tiny_llama(attention: str) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        attn_implementation=attention,
    )
    return LlamaForCausalLM(config).eval()


def random_examples(lengths, seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(64, (n,), generator=generator).tolist()} for n in lengths]


# --------------------------------------------------------------------------- rows and batches


def test_best_fit_decreasing_puts_each_example_where_it_fills_a_row_most():
    assert best_fit_decreasing([5, 3, 8, 2, 6, 1], 10) == [[2, 3], [4, 1, 5], [0]]
    lengths = [(7 * i) % 23 + 1 for i in range(200)]
    bins = best_fit_decreasing(lengths, 32)
    assert sorted(index for row in bins for index in row) == list(range(200))
    assert all(sum(lengths[index] for index in row) <= 32 for row in bins)
    assert len(bins) <= 1.1 * sum(lengths) / 32 + 1, "best-fit-decreasing leaves little room"


def test_the_collator_restarts_positions_and_masks_each_example_s_first_target():
    rows = [
        [{"input_ids": [5, 6, 7], "labels": [IGNORE_INDEX, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}],
        [{"input_ids": [3, 4], "labels": [IGNORE_INDEX, 4]}],
    ]
    batch = PackedBatches(0)(rows)
    assert "attention_mask" not in batch and batch["real_tokens"] == 7
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9], [3, 4, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]], "padding is a sequence of its own"
    assert batch["labels"].tolist() == [[IGNORE_INDEX, 6, 7, IGNORE_INDEX, 9], [IGNORE_INDEX, 4, *[IGNORE_INDEX] * 3]]
    flat = PackedBatches(0, flash_attention=True)(rows)
    assert flat["input_ids"].tolist() == [[5, 6, 7, 8, 9, 3, 4]] and flat["cu_seq_lens_q"].tolist() == [0, 3, 5, 7]


def test_documents_are_cut_at_the_block_size_and_packed():
    end = 1
    pieces = document_pieces([[5, 6], [7, 8, end], [9, end], [4, 4, 4, 4, 4]], end, block_size=3)
    assert pieces == [[5, 6, 7], [8, end], [9, end], [4, 4, 4], [4, 4]]
    import datasets

    rows = PackedRows(datasets.Dataset.from_dict({"input_ids": pieces}), [len(p) for p in pieces], 4)
    assert rows.bins == [[0], [3], [1, 2], [4]] and rows.lengths == [3, 3, 4, 2]


# --------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_logits_equal_each_example_run_alone(attention):
    model, task = tiny_llama(attention), CausalLMTask(16, 1)
    examples = random_examples([5, 9, 2, 7, 12])
    rows = [examples[:3], examples[3:]]
    with torch.no_grad():
        packed = task.logits(model, PackedBatches(0)(rows))
        for row, (number, start) in [(0, (0, 0)), (0, (1, 5)), (0, (2, 14)), (1, (3, 0)), (1, (4, 7))]:
            ids = torch.tensor([examples[number]["input_ids"]])
            alone = model(input_ids=ids, use_cache=False).logits[0]
            torch.testing.assert_close(packed[row, start : start + ids.size(1)], alone, rtol=0, atol=1e-5)
    assert check_packable(model, task, PackedBatches(0), 64, "cpu") < 1e-5


class CacheForcedOn(nn.Module):
    """A wrapper that always asks for a cache: Transformers then ignores the position ids' boundaries."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, **kwargs):
        return self.inner(**{**kwargs, "use_cache": True})


class NoPositions(CacheForcedOn):
    def forward(self, input_ids, attention_mask=None, use_cache=None):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache)


def token_convolution(model):
    """A causal convolution over the token embeddings (as Mamba-style and LFM layers have): blind to position ids."""
    embed = model.get_input_embeddings()
    embed.register_forward_hook(lambda module, args, out: out + nn.functional.pad(out, (0, 0, 1, 0))[:, :-1])
    return model


@pytest.mark.parametrize(
    "make,reason",
    [
        (lambda: CacheForcedOn(tiny_llama("sdpa")), "does not give a packed example its own logits"),
        (lambda: token_convolution(tiny_llama("eager")), "does not give a packed example its own logits"),
        (lambda: NoPositions(tiny_llama("sdpa")), "cannot take packed rows (CacheForcedOn.forward() got an unexpected"),
    ],
    ids=["cache", "convolution", "no-position-ids"],
)
def test_a_model_that_would_mix_packed_examples_is_refused_in_one_line(make, reason):
    model = make().train()
    with pytest.raises(ConfigError) as refused:
        check_packable(model, CausalLMTask(16, 1), PackedBatches(0), 64, "cpu")
    message = str(refused.value).replace("NoPositions", "CacheForcedOn")
    assert message.startswith("--packing: ") and "\n" not in message and reason in message, message
    assert message.endswith("train without --packing") and model.training, "the model is left in training mode"


def test_eval_loss_of_packed_rows_equals_the_unpacked_eval_loss(data):
    import datasets
    from transformers import AutoModelForCausalLM

    from acceltrain.text import pretrained_tokenizer

    tokenizer, model = pretrained_tokenizer(None, str(data.llama)), AutoModelForCausalLM.from_pretrained(data.llama)
    columns = {"prompt": "prompt", "response": "response", "messages": None}
    rows = datasets.Dataset.from_list(skewed(24, seed=3))
    examples, lengths, _ = sft_kept(
        sft_examples(rows, tokenizer, block_size=64, where="rows", **columns), block_size=64, where="rows"
    )
    task = CausalLMTask(16, 1)

    def eval_loss(batches):
        sums = {"loss_sum": 0.0, "tokens": 0.0}
        with torch.no_grad():
            for batch in batches:
                for key, values in task.eval_values(model.eval(), batch).items():
                    sums[key] += values.sum().item()
        return task.eval_metrics(sums, 0)["loss"]

    padded = sft_batches(tokenizer)
    unpacked = eval_loss(padded([examples[i] for i in range(start, start + 4)]) for start in range(0, len(examples), 4))
    packed_rows = PackedRows(examples, lengths, 64)
    assert len(packed_rows) < len(examples) / 2
    packed = eval_loss(
        PackedBatches(tokenizer.eos_token_id)([packed_rows[i] for i in range(len(packed_rows))]) for _ in [0]
    )
    assert packed == pytest.approx(unpacked, rel=1e-5)


# --------------------------------------------------------------------------- the recipe


def test_a_packed_sft_run_resumes_byte_identically_and_reports_its_real_tokens(tmp_path, data):
    args = [
        *QUIET,
        "--model-name-or-path",
        str(data.llama),
        "--train-file",
        str(data.rows),
        "--block-size",
        "64",
        "--batch-size",
        "2",
        "--max-steps",
        "6",
        "--log-every",
        "2",
        "--eval-fraction",
        "0.25",
    ]
    full, part, unpacked = tmp_path / "full", tmp_path / "part", tmp_path / "unpacked"
    assert run(full, *args, "--packing") == 0
    assert run(part, *args, "--packing", "--stop-after-steps", "4") == EXIT_PREEMPTED
    assert run(part, *args, "--packing", "--resume", "auto") == 0
    assert (part / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()
    assert run(unpacked, *args) == 0
    packed_summary, padded_summary = read_summary(full), read_summary(unpacked)
    for summary in (packed_summary, padded_summary):
        assert summary["real_tokens_per_second"] > 0 and 0 < summary["real_token_share"] <= 1
    assert packed_summary["real_token_share"] > padded_summary["real_token_share"]
    assert packed_summary["eval_loss"] > 0 and packed_summary["samples_seen"] == 12
    rows = [row for row in read_events(full) if "loss" in row and "step" in row]
    assert rows and all("real_tokens_per_second" in row and "real_token_share" in row for row in rows)


def test_plain_text_documents_train_packed_and_resume_byte_identically(tmp_path, data):
    text = tmp_path / "a.txt"
    text.write_text("".join(f"line {i} of a short document\n" for i in range(40)).rstrip("\n"))
    args = [*QUIET, "--text-files", str(text), "--model", "llama-tiny", "--block-size", "32", "--max-steps", "4"]
    args += ["--packing", "--vocab-size", "300", "--batch-size", "2"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert run(full, *args) == 0
    summary = read_summary(full)
    assert summary["real_token_share"] > 0.5 and summary["eval_loss"] > 0
    assert run(part, *args, "--stop-after-steps", "2") == EXIT_PREEMPTED
    assert run(part, *args, "--resume", "auto") == 0
    assert (part / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_train_packed_rows_as_one_process_does(tmp_path, data):
    """Packed rows hold different numbers of targets, so each optimizer step's loss is normalised per target token
    over the processes and the accumulation window: 2 processes of 2 rows and 2 accumulated micro-batches of 2 rows
    each end where one batch of 4 rows does."""
    args = [*QUIET, "--model-name-or-path", str(data.llama), "--train-file", str(data.rows), "--packing"]
    args += ["--block-size", "64", "--max-steps", "3", "--optimizer", "sgd", "--lr", "0.5", "--max-grad-norm", "none"]
    one, accumulated, two = tmp_path / "one", tmp_path / "accumulated", tmp_path / "two"
    assert run(one, *args, "--batch-size", "4") == 0
    assert run(accumulated, *args, "--batch-size", "2", "--grad-accum", "2") == 0
    check(
        launch(
            REPO / "recipes" / "causal_lm.py",
            [*args, "--batch-size", "2", "--output-dir", str(two)],
            processes=2,
            launcher="accelerate",
            HF_HOME=str(data.root / "hf" / "home"),
            HF_DATASETS_CACHE=str(tmp_path / "datasets"),
            HF_HUB_OFFLINE="1",
        )
    )
    assert read_summary(two)["num_processes"] == 2
    for other in (accumulated, two):
        assert_same_weights(other, one)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--streaming", "--max-steps", "1"], "error: --packing packs rows held in memory: not with --streaming"),
        (["--group-by-length"], "error: --packing and --group-by-length both cut padding: choose one"),
    ],
)
def test_packing_with_what_it_cannot_go_with_is_one_line(tmp_path, data, capsys, extra, message):
    assert run(tmp_path / "out", *QUIET, "--text-files", str(data.rows), "--packing", *extra) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and "\n" not in err, err


def test_the_recipe_refuses_a_model_that_mixes_packed_examples_before_training(tmp_path, data, capsys, monkeypatch):
    """The check runs on the prepared model in the run: here the task's forward is made to ask for a cache."""
    plain = CausalLMTask.logits

    def with_cache(self, model, batch):
        if "position_ids" not in batch:
            return plain(self, model, batch)
        return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=True).logits

    monkeypatch.setattr(CausalLMTask, "logits", with_cache)
    out = tmp_path / "out"
    args = [
        "--model-name-or-path",
        str(data.llama),
        "--train-file",
        str(data.rows),
        "--max-steps",
        "1",
        "--batch-size",
        "2",
    ]
    assert run(out, *QUIET, *args, "--packing") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --packing: LlamaForCausalLM (sdpa attention) does not give a packed example its own")
    assert "\n" not in err and not out.exists(), err
