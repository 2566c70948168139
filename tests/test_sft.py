"""Supervised fine-tuning in the causal-LM recipe (issue 33 item 2) on tiny GPT-2 and Llama folders made here:
labels on response tokens only (prompt/response rows and chat conversations), the token-normalised loss under
accumulation, eval_loss per response token, a LoRA adapter that resumes byte-identically and reloads in a fresh
process, one-line bad input. Offline, one thread."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, read_summary, subprocess_env
from safetensors import safe_open
from test_causal_lm import offline_on_one_thread

from acceltrain.checkpoint.files import complete_checkpoints
from acceltrain.runtime.preemption import EXIT_PREEMPTED
from acceltrain.text import IGNORE_INDEX, sft_examples, sft_kept

sys.path.insert(0, str(REPO / "recipes"))
sys.path.insert(0, str(REPO / "tests" / "helpers"))
import causal_lm  # noqa: E402
from in_process import Predictions, recording, run_in_process  # noqa: E402
from pretrained_folders import causal_lm_folder, conversations, instructions, write_rows  # noqa: E402

QUIET = [
    "--num-workers",
    "0",
    "--num-proc",
    "1",
    "--no-progress",
    "--report-to",
    "none",
    "--no-plots",
    "--log-every",
    "2",
    "--block-size",
    "64",
]
# plain SGD without clipping: the update is the gradient itself, so a token weighed wrongly shows
EXACT = [*QUIET, "--optimizer", "sgd", "--lr", "0.5", "--momentum", "0", "--max-grad-norm", "none", "--max-steps", "3"]


def run(output_dir: Path, *args: str) -> int:
    return run_in_process(causal_lm.main, causal_lm.CausalLMConfig, output_dir, *args)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("sft")
    with offline_on_one_thread(root / "hf"):
        gpt2, llama = (
            causal_lm_folder(root / "gpt2"),
            causal_lm_folder(root / "llama", arch="llama", chat_template=True),
        )
    return SimpleNamespace(
        root=root,
        gpt2=gpt2,
        llama=llama,
        rows=write_rows(root / "sft.jsonl", instructions(64)),
        eval=write_rows(root / "eval.jsonl", instructions(16, seed=1)),
        chat=write_rows(root / "chat.jsonl", conversations(48)),
    )


@pytest.fixture(autouse=True)
def offline(data):
    with offline_on_one_thread(data.root / "hf"):
        yield


def encoded(tokenizer, rows: list[dict], block_size: int = 64, **columns):
    import datasets

    columns = {"prompt": "prompt", "response": "response", "messages": None, **columns}
    return sft_kept(
        sft_examples(datasets.Dataset.from_list(rows), tokenizer, block_size=block_size, where="the rows", **columns),
        block_size=block_size,
        where="the rows",
    )


def test_prompt_and_response_rows_train_on_the_response_and_its_end_only(data):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(data.gpt2)
    examples, lengths, counts = encoded(tokenizer, [{"prompt": "question: good answer:", "response": " bad bad"}])
    ids, labels = examples[0]["input_ids"], examples[0]["labels"]
    prompt, response = (
        tokenizer("question: good answer:")["input_ids"],
        tokenizer(" bad bad", add_special_tokens=False)["input_ids"],
    )
    assert ids == [*prompt, *response, tokenizer.eos_token_id] and lengths == [len(ids)]
    assert labels == [IGNORE_INDEX] * len(prompt) + [*response, tokenizer.eos_token_id]
    assert counts == {"truncated": 0, "dropped": 0}


def test_a_conversation_trains_on_each_assistant_turn_as_the_chat_template_renders_it(data):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(data.llama)
    messages = [
        {"role": "user", "content": "question: good"},
        {"role": "assistant", "content": "good good"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "bad"},
    ]
    examples, _, _ = encoded(tokenizer, [{"messages": messages}], messages="messages")
    ids, labels = examples[0]["input_ids"], examples[0]["labels"]
    assert ids == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    trained = tokenizer.convert_ids_to_tokens(
        [token for token, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX]
    )
    assert trained == ["good", "good", "<|im_end|>", "bad", "<|im_end|>"], (
        "the answers and their ends, nothing of the user's"
    )


def test_examples_longer_than_the_block_are_cut_and_those_without_a_response_token_dropped(data):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(data.gpt2)
    rows = [
        {"prompt": "good", "response": " bad" * 10},
        {"prompt": "good " * 8, "response": " bad"},
        {"prompt": "good", "response": " bad"},
    ]
    examples, lengths, counts = encoded(tokenizer, rows, block_size=6)
    assert counts == {"truncated": 1, "dropped": 1} and lengths == [6, 3] and len(examples) == 2
    assert examples[0]["labels"] == [IGNORE_INDEX] + examples[0]["input_ids"][1:], (
        "the response, cut at the block's end"
    )


@pytest.fixture(scope="module")
def big_batch(data) -> Path:
    """One step = 8 rows at once: what accumulation must reproduce."""
    out = data.root / "big"
    with offline_on_one_thread(data.root / "hf"):
        assert (
            run(
                out,
                *EXACT,
                "--model-name-or-path",
                str(data.gpt2),
                "--train-file",
                str(data.rows),
                "--eval-file",
                str(data.eval),
                "--batch-size",
                "8",
            )
            == 0
        )
    return out


def test_accumulation_gives_the_big_batch_s_update_with_responses_of_every_length(tmp_path, data, big_batch, capsys):
    out = tmp_path / "accumulated"
    assert (
        run(
            out,
            *EXACT,
            "--model-name-or-path",
            str(data.gpt2),
            "--train-file",
            str(data.rows),
            "--eval-file",
            str(data.eval),
            "--batch-size",
            "2",
            "--grad-accum",
            "4",
        )
        == 0
    )
    assert (
        "tokenizer: no pad token; batches are padded with the end-of-text token '<|endoftext|>' (masked out)"
        in capsys.readouterr().out
    )
    from safetensors.torch import load_file

    reference = load_file(str(big_batch / "model.safetensors"))
    for name, tensor in load_file(str(out / "model.safetensors")).items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-4, atol=1e-6, msg=name)


def test_eval_loss_is_the_mean_loss_of_the_response_tokens(data, big_batch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(big_batch).eval(), AutoTokenizer.from_pretrained(big_batch)
    total, count = 0.0, 0
    for row in instructions(16, seed=1):
        prompt = tokenizer(row["prompt"])["input_ids"]
        ids = prompt + tokenizer(row["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1]
        losses = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")[len(prompt) - 1 :]
        total, count = total + losses.sum().item(), count + len(losses)
    summary = read_summary(big_batch)
    assert summary["eval_loss"] == pytest.approx(total / count, rel=1e-5)
    assert summary["dropped_examples"] == {"train": 0, "eval": 0} and 0 < summary["padded_token_fraction"] < 1


LOAD_AS_THE_CARD_SAYS = """
import sys, torch
from transformers import AutoTokenizer
folder, text = sys.argv[1:]
namespace = {}
exec(open(folder + "/README.md").read().split("```python\\n")[1].split("```")[0], namespace)  # the card's own call
model = namespace["model"].eval()
with torch.no_grad():
    logits = model(**AutoTokenizer.from_pretrained(folder)([text], return_tensors="pt")).logits
    torch.save(logits, folder + "/reloaded_logits.pt")
print(type(model).__name__)
"""


@pytest.mark.slow
def test_a_lora_chat_run_resumes_byte_identically_and_its_adapter_reloads_in_a_fresh_process(tmp_path, data):
    text = "<|im_start|>user\nquestion: good answer:<|im_end|>\n<|im_start|>assistant\n"
    args = [
        *QUIET,
        "--model-name-or-path",
        str(data.llama),
        "--train-file",
        str(data.chat),
        "--eval-fraction",
        "0.25",
        "--batch-size",
        "4",
        "--max-steps",
        "6",
        "--lr",
        "1e-2",
        "--lora-r",
        "4",
        "--lora-target-modules",
        "q_proj,v_proj,o_proj",
        "--group-by-length",
        "--eval-every",
        "3",
    ]
    full, part = tmp_path / "full", tmp_path / "part"
    with recording(Predictions([text])) as predictions:
        assert run(full, *args) == 0
    assert run(part, *args, "--stop-after-steps", "4") == EXIT_PREEMPTED
    (checkpoint,) = complete_checkpoints(part)  # the adapter's weights alone: the frozen base comes from its folder
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as saved:
        assert saved.keys() and all("lora_" in key for key in saved.keys()), sorted(saved.keys())[:5]
    assert run(part, *args, "--resume", "auto") == 0
    assert (part / "adapter_model.safetensors").read_bytes() == (full / "adapter_model.safetensors").read_bytes()
    adapter = json.loads((full / "adapter_config.json").read_text())
    assert adapter["task_type"] == "CAUSAL_LM" and sorted(adapter["target_modules"]) == ["o_proj", "q_proj", "v_proj"]
    assert "from peft import AutoPeftModelForCausalLM" in (full / "README.md").read_text()
    result = subprocess.run(
        [sys.executable, "-c", LOAD_AS_THE_CARD_SAYS, str(full), text],
        env=subprocess_env(HF_HUB_OFFLINE="1"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0 and result.stdout.strip() == "PeftModelForCausalLM", result.stderr[-3000:]
    torch.testing.assert_close(
        torch.load(full / "reloaded_logits.pt"), predictions.logits["full"], rtol=1e-4, atol=1e-5
    )


def test_an_adapter_folder_as_the_model_trains_its_adapter_on(tmp_path, data):
    """Round 5 (issue 38, item 11): an SFT adapter folder as --model-name-or-path was "ValueError: optimizer got an
    empty parameter list" (Transformers loaded its adapter frozen), the tokenizer left in the output folder."""
    from safetensors.torch import load_file

    adapter, continued = tmp_path / "adapter", tmp_path / "continued"
    args = [*QUIET, "--train-file", str(data.chat), "--batch-size", "4", "--max-steps", "2"]
    lora = ["--lora-r", "4", "--lora-target-modules", "q_proj,v_proj"]
    assert run(adapter, *args, "--model-name-or-path", str(data.llama), *lora) == 0
    assert run(continued, *args, "--model-name-or-path", str(adapter), "--lr", "1e-12") == 0
    before = load_file(str(adapter / "adapter_model.safetensors"))
    after = load_file(str(continued / "adapter_model.safetensors"))
    assert before.keys() == after.keys()
    for name, tensor in after.items():
        torch.testing.assert_close(tensor, before[name], msg=name)
    assert 0 < read_summary(continued)["trainable_parameters"] < read_summary(continued)["parameters"]


# --------------------------------------------------------------------------- bad input


# as many published chat templates do: a role it does not know is the template's own exception
STRICT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('Conversation roles must be user, assistant or system') }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def bad(data) -> dict[str, Path]:
    import shutil

    from transformers import AutoTokenizer

    root = data.root / "bad"
    root.mkdir()
    rows = instructions(6)
    strict = shutil.copytree(data.llama, root / "strict")
    tokenizer = AutoTokenizer.from_pretrained(strict)
    tokenizer.chat_template = STRICT_TEMPLATE
    tokenizer.save_pretrained(strict)
    chats = conversations(8)
    bot = [
        {"role": "bot" if message["role"] == "assistant" else "user", "content": message["content"]}
        for message in chats[5]["messages"]
    ]
    greeting = [
        {"role": "assistant", "content": "good"},
        {"role": "user", "content": "bad"},
        {"role": "assistant", "content": "bad"},
    ]
    return {
        "empty_response": write_rows(
            root / "empty_response.jsonl", [*rows[:2], {"prompt": "good", "response": " "}, *rows[2:]]
        ),
        "long_prompts": write_rows(root / "long_prompts.jsonl", [{"prompt": "good " * 70, "response": " bad"}] * 4),
        "no_assistant": write_rows(
            root / "no_assistant.jsonl", [{"messages": [{"role": "user", "content": "good"}]}] * 4
        ),
        "strict": strict,
        "bot_role": write_rows(
            root / "bot_role.jsonl", [*chats[:5], {"messages": [*bot, *chats[5]["messages"]]}, *chats[6:]]
        ),
        "assistant_first": write_rows(root / "assistant_first.jsonl", [*chats[:3], {"messages": greeting}, *chats[3:]]),
    }


BAD_INPUTS = [
    (
        ["--model-name-or-path", "{gpt2}", "--train-file", "{empty_response}"],
        "row 2 of --train-file '{empty_response}': the response ('response' column) is empty: nothing to train on",
    ),
    (
        ["--model-name-or-path", "{gpt2}", "--train-file", "{long_prompts}"],
        "--block-size 64: every example of --train-file '{long_prompts}' has a prompt that fills it, leaving no "
        "response token",
    ),
    (
        ["--model-name-or-path", "{gpt2}", "--train-file", "{chat}"],
        "--train-file '{chat}' has a 'messages' column but the tokenizer has no chat template to render it",
    ),
    (
        ["--model-name-or-path", "{llama}", "--train-file", "{no_assistant}"],
        "row 0 of --train-file '{no_assistant}': the conversation has no assistant message to train on",
    ),
    # issue 38 items 9 and 10: a jinja2 TemplateError through the tokenising pool; ValueError: ... an empty conversation
    (
        ["--model-name-or-path", "{strict}", "--train-file", "{bot_role}", "--num-proc", "2"],
        "row 5 of --train-file '{bot_role}': the tokenizer's chat template refuses the conversation: Conversation "
        "roles must be user, assistant or system",
    ),
    (
        ["--model-name-or-path", "{llama}", "--train-file", "{assistant_first}"],
        "row 3 of --train-file '{assistant_first}': the conversation starts with an assistant message, which no prompt "
        "precedes to train it on: start it with a user (or system) message",
    ),
    (
        ["--model-name-or-path", "{gpt2}", "--train-file", "{rows}", "--prompt-column", "question"],
        "--prompt-column 'question' is not a column of --train-file '{rows}': its columns are prompt, response",
    ),
    (["--train-file", "{rows}"], "--train-file fine-tunes a pretrained model: give it with --model-name-or-path"),
    (
        ["--text-files", "{rows}", "--lora-r", "8"],
        "--lora-r adapts a pretrained model: give it with --model-name-or-path",
    ),
    (
        ["--model-name-or-path", "{gpt2}", "--train-file", "{rows}", "--lora-r", "8", "--lora-target-modules", "c_atn"],
        "--lora-target-modules 'c_atn' is not a module of GPT2LMHeadModel: close names: c_attn",
    ),
    (
        ["--model-name-or-path", "{gpt2}", "--train-file", "{rows}", "--text-files", "{rows}"],
        "give one of --train-file (SFT rows)",
    ),
]


@pytest.mark.parametrize("argv,message", BAD_INPUTS, ids=[f"{i}-{m.split()[0]}" for i, (_, m) in enumerate(BAD_INPUTS)])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, data, bad, capsys, argv, message):
    names = {"gpt2": data.gpt2, "llama": data.llama, "rows": data.rows, "chat": data.chat, **bad}
    out = tmp_path / "out"
    assert run(out, *QUIET, *[arg.format(**names) for arg in argv], "--max-steps", "1") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and message.format(**names) in err, err
    assert not out.exists(), "bad input must not write anything"
