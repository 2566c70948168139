"""``acceltrain merge`` (issue 38, round 5 of hostile inputs): every checkpoint becomes a folder that loads with every
weight it merged, or one line. LoRA checkpoints (adapter runs, --merge-lora runs, FSDP's shards) merge into their
base; a stopped run's checkpoint gets its config from the files the run writes beside its checkpoints; a checkpoint
of another model is refused; relative paths find the run folder; a missing path and a run folder are said in
merge's words. Tiny BERT, GPT-2 and ResNet runs, offline, one thread."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, check, launch, read_summary
from safetensors.torch import load_file
from test_causal_lm import offline_on_one_thread

from acceltrain.checkpoint.files import complete_checkpoints, verify_checkpoint
from acceltrain.checkpoint.state import CheckpointError
from acceltrain.commands.cli import main
from acceltrain.runtime.preemption import EXIT_PREEMPTED

sys.path.insert(0, str(REPO / "recipes"))
sys.path.insert(0, str(REPO / "tests" / "helpers"))
import causal_lm  # noqa: E402
import text_classification  # noqa: E402
from in_process import run_in_process  # noqa: E402
from pretrained_folders import bert_folder, causal_lm_folder, instructions, reviews, write_rows  # noqa: E402

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
    "--max-steps",
    "4",
    "--save-every-steps",
    "2",
]
CLASSIFY = [*QUIET, "--batch-size", "8", "--lr", "5e-3", "--max-length", "48"]
SFT = [*QUIET, "--batch-size", "4", "--lr", "1e-2", "--block-size", "64"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("merge")
    with offline_on_one_thread(root / "hf"):
        bert, gpt2 = bert_folder(root / "bert"), causal_lm_folder(root / "gpt2")
    return SimpleNamespace(
        root=root,
        bert=bert,
        gpt2=gpt2,
        train=write_rows(root / "train.csv", reviews(64)),
        sft=write_rows(root / "sft.jsonl", instructions(32)),
    )


@pytest.fixture(autouse=True)
def offline(data):
    with offline_on_one_thread(data.root / "hf"):
        yield


def classify(out: Path, data, *args: str) -> int:
    return run_in_process(
        text_classification.main,
        text_classification.TextClassificationConfig,
        out,
        *CLASSIFY,
        "--model-name-or-path",
        str(data.bert),
        "--train-file",
        str(data.train),
        *args,
    )


def fine_tune(out: Path, data, *args: str) -> int:
    return run_in_process(
        causal_lm.main,
        causal_lm.CausalLMConfig,
        out,
        *SFT,
        "--model-name-or-path",
        str(data.gpt2),
        "--train-file",
        str(data.sft),
        *args,
    )


@pytest.fixture(scope="module")
def runs(data) -> SimpleNamespace:
    """A classifier trained in full, a --merge-lora classifier run and an SFT adapter run, finished; a classifier
    adapter run and a full SFT run, stopped at step 2 (their folders hold no config.json of their own)."""
    root = data.root / "runs"
    made = SimpleNamespace(
        merged=root / "merged",
        adapter=root / "adapter",
        stopped_adapter=root / "stopped_adapter",
        stopped=root / "stopped",
        full=root / "full",
    )
    with offline_on_one_thread(data.root / "hf"):
        assert classify(made.full, data, "--max-steps", "2") == 0
        assert classify(made.merged, data, "--lora-r", "4", "--merge-lora") == 0
        assert fine_tune(made.adapter, data, "--lora-r", "4") == 0
        assert classify(made.stopped_adapter, data, "--lora-r", "4", "--stop-after-steps", "2") == EXIT_PREEMPTED
        assert fine_tune(made.stopped, data, "--stop-after-steps", "2") == EXIT_PREEMPTED
    return made


def merged(checkpoint: Path, out: Path, capsys) -> Path:
    assert main(["merge", str(checkpoint), str(out)]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.strip().endswith(f"wrote {out / 'model.safetensors'}")
    return out


def loads_every_weight(folder: Path, auto_class: str):
    """``from_pretrained(folder)``: nothing missing, unexpected or reshaped, and every weight the file's."""
    import transformers

    model, info = getattr(transformers, auto_class).from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info
    state = model.state_dict()
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        assert torch.equal(state[name], tensor), name
    return model


@pytest.mark.slow
def test_a_merge_lora_run_s_checkpoint_merges_into_its_base(tmp_path, runs, capsys):
    """Item 2: the run folder's config.json was written beside the adapter's peft-named tensors, and from_pretrained
    built a random model with a warning. The last checkpoint now merges into the very weights the run exported."""
    out = merged(complete_checkpoints(runs.merged)[-1], tmp_path / "out", capsys)
    assert load_file(str(out / "model.safetensors")).keys() == load_file(str(runs.merged / "model.safetensors")).keys()
    for name, tensor in load_file(str(runs.merged / "model.safetensors")).items():
        torch.testing.assert_close(load_file(str(out / "model.safetensors"))[name], tensor, msg=name)
    model = loads_every_weight(out, "AutoModelForSequenceClassification")
    assert model.config.id2label == {0: "neg", 1: "pos"} and (out / "tokenizer.json").is_file()


def test_an_sft_adapter_run_s_checkpoint_merges_as_peft_merges_its_adapter(tmp_path, runs, capsys):
    """Item 2, SFT: GPT-2 ties its output head to the embeddings; the merged folder holds both names, as the run's."""
    from peft import AutoPeftModelForCausalLM

    out = merged(complete_checkpoints(runs.adapter)[-1], tmp_path / "out", capsys)
    model = loads_every_weight(out, "AutoModelForCausalLM")
    expected = AutoPeftModelForCausalLM.from_pretrained(runs.adapter).merge_and_unload().state_dict()
    assert model.state_dict().keys() == expected.keys()
    assert "lm_head.weight" in load_file(str(out / "model.safetensors")), "tied: under each name, as the run's"
    for name, tensor in expected.items():
        torch.testing.assert_close(model.state_dict()[name], tensor, msg=name)
    assert (out / "generation_config.json").is_file() and not (out / "adapter_config.json").exists()


def test_a_stopped_run_s_checkpoints_merge_with_the_config_its_run_wrote_beside_them(tmp_path, runs, capsys):
    """Item 5: a run folder gets config.json only at its end, and merge wrote none for a stopped run. The run now
    describes its model beside its checkpoints at its first save: an adapter's base as training set it (the labels)."""
    for run in (runs.stopped, runs.stopped_adapter):
        assert not (run / "config.json").exists() and (run / "checkpoints" / "config.json").is_file()
    out = merged(complete_checkpoints(runs.stopped)[-1], tmp_path / "sft", capsys)
    loads_every_weight(out, "AutoModelForCausalLM")
    saved = load_file(str(complete_checkpoints(runs.stopped)[-1] / "model.safetensors"))
    assert all(torch.equal(load_file(str(out / "model.safetensors"))[name], tensor) for name, tensor in saved.items())
    from acceltrain import load_model

    assert type(load_model(out)).__name__ == "GPT2LMHeadModel"
    out = merged(complete_checkpoints(runs.stopped_adapter)[-1], tmp_path / "classifier", capsys)
    assert loads_every_weight(out, "AutoModelForSequenceClassification").config.id2label == {0: "neg", 1: "pos"}


def test_a_stopped_resnet_run_s_checkpoint_loads_with_load_model(tmp_path, capsys, monkeypatch):
    """Item 5: acceltrain.load_model refused the merged folder of a stopped ResNet run (no config.json)."""
    from test_hub import run_cifar

    from acceltrain import load_model

    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert run_cifar(tmp_path / "run", "--stop-after-steps", "1", monkeypatch=monkeypatch) == EXIT_PREEMPTED
    (checkpoint,) = complete_checkpoints(tmp_path / "run")
    model = load_model(merged(checkpoint, tmp_path / "out", capsys))
    assert type(model).__name__ == "TinyResNet"
    for name, tensor in load_file(str(checkpoint / "model.safetensors")).items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_a_checkpoint_of_another_model_is_refused_and_out_left_as_it_was(tmp_path, runs, capsys):
    """Item 4: a BERT checkpoint copied into a GPT-2 run was written beside the GPT-2 config."""
    run = shutil.copytree(runs.stopped, tmp_path / "gpt2-run")
    bert = shutil.copytree(complete_checkpoints(runs.full)[-1], run / "checkpoints" / "step_00000005")
    adapter = shutil.copytree(complete_checkpoints(runs.stopped_adapter)[-1], run / "checkpoints" / "step_00000006")
    (tmp_path / "empty").mkdir()
    assert main(["merge", str(bert), str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        f"error: checkpoint {str(bert)!r} holds weights that would not load into the model of "
        f"{run.resolve() / 'checkpoints' / 'config.json'} (missing 'lm_head.weight'"
    ), err
    assert err.endswith("a checkpoint of another model? Merge it in its own run folder") and "\n" not in err
    assert main(["merge", str(adapter), str(tmp_path / "new" / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        f"error: checkpoint {str(adapter)!r} holds a LoRA adapter's weights (peft names) and no "
        "adapter_config.json beside its checkpoints or in its run folder describes its model"
    ), err
    assert not any((tmp_path / "empty").iterdir()) and not (tmp_path / "new").exists(), "OUT left as it was"


def test_a_lora_checkpoint_whose_base_model_is_not_there_is_one_line(tmp_path, runs, capsys):
    """Items 2 and 3: a LoRA checkpoint merges into its base model, or says it cannot."""
    run = shutil.copytree(runs.stopped_adapter, tmp_path / "run")
    described = run / "checkpoints" / "adapter_config.json"
    adapter = json.loads(described.read_text())
    described.write_text(json.dumps({**adapter, "base_model_name_or_path": str(tmp_path / "gone")}))
    checkpoint = complete_checkpoints(run)[-1]
    assert main(["merge", str(checkpoint), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: checkpoint {str(checkpoint)!r} holds a LoRA adapter for the base model "
        f"{str(tmp_path / 'gone')!r}: no such file or folder"
    )
    assert not (tmp_path / "out").exists()


def test_relative_checkpoint_paths_find_their_run_folder(tmp_path, runs, capsys, monkeypatch):
    """Item 6: checkpoint.parent.parent of a relative path is not the run folder: config and tokenizer were dropped."""
    checkpoint = complete_checkpoints(runs.stopped)[-1]
    monkeypatch.chdir(checkpoint.parent)
    for name, given in (("below", checkpoint.name), ("inside", ".")):
        if name == "inside":
            monkeypatch.chdir(checkpoint)
        assert main(["merge", given, str(tmp_path / name)]) == 0
        written = {path.name for path in (tmp_path / name).iterdir()}
        assert {"config.json", "tokenizer.json", "model.safetensors"} <= written, name
    capsys.readouterr()


def test_what_is_not_a_checkpoint_is_said_in_merge_s_words(tmp_path, runs, capsys):
    """Item 13: merge has no --resume, and a run folder is not an incomplete checkpoint."""
    newest = f"its newest checkpoint is {str(complete_checkpoints(runs.merged)[-1])!r}"
    checkpoints = runs.merged / "checkpoints"
    for given, message in (
        (tmp_path / "nothing", f"CHECKPOINT {str(tmp_path / 'nothing')!r}: no such checkpoint folder"),
        (runs.merged, f"CHECKPOINT {str(runs.merged)!r} is a run folder, not a checkpoint: {newest}"),
        (
            checkpoints,
            f"CHECKPOINT {str(checkpoints)!r} is the checkpoints folder of a run, not a checkpoint: {newest}",
        ),
    ):
        assert main(["merge", str(given), str(tmp_path / "out")]) == 2
        assert capsys.readouterr().err.strip() == f"error: {message}"
    with pytest.raises(CheckpointError, match=r"^--resume '.*nothing': no such checkpoint folder$"):
        verify_checkpoint(tmp_path / "nothing")  # --resume's own words, unchanged


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_fsdp_lora_checkpoint_merges_into_its_base(tmp_path, data, capsys):
    """Item 3: FSDP's shards of an adapter run merged into peft-named tensors with neither config.json nor
    adapter_config.json: nothing could load them."""
    from peft import AutoPeftModelForSequenceClassification

    out = tmp_path / "run"
    hf = data.root / "hf"
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(hf / "home"), "HF_DATASETS_CACHE": str(hf / "datasets")}
    args = [
        *CLASSIFY,
        "--model-name-or-path",
        str(data.bert),
        "--train-file",
        str(data.train),
        "--lora-r",
        "4",
        "--batch-size",
        "4",
        "--output-dir",
        str(out),
    ]
    check(
        launch(
            REPO / "recipes" / "text_classification.py",
            args,
            processes=2,
            launcher="accelerate",
            config="fsdp_cpu.yaml",
            **env,
        )
    )
    assert read_summary(out)["distributed_type"] == "FSDP"
    checkpoint = complete_checkpoints(out)[-1]
    assert (checkpoint / "pytorch_model_fsdp_0").is_dir()
    folder = merged(checkpoint, tmp_path / "merged", capsys)
    model = loads_every_weight(folder, "AutoModelForSequenceClassification")
    labels = json.loads((out / "checkpoints" / "config.json").read_text())["id2label"]
    adapter = AutoPeftModelForSequenceClassification.from_pretrained(out, num_labels=len(labels))
    expected = adapter.merge_and_unload().state_dict()
    for name, tensor in expected.items():
        torch.testing.assert_close(model.state_dict()[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.multiprocess
def test_several_processes_are_refused_before_out_is_written(tmp_path, runs):
    """Issue 43 item 10: under ``accelerate launch`` each process merged into OUT; one found it no longer empty and
    refused, the launcher stopped the other mid-write: exit 1, and OUT kept a lone config.json. Merge has no work to
    share, so each process now refuses at once (the main one prints the line) and OUT is never made."""
    script = tmp_path / "acceltrain_cli.py"  # what the `acceltrain` console script runs
    script.write_text("from acceltrain.commands.cli import main\n\nraise SystemExit(main())\n")
    out = tmp_path / "out"
    result = launch(
        script, ["merge", str(complete_checkpoints(runs.stopped)[-1]), str(out)], processes=2, launcher="accelerate"
    )
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: acceltrain merge runs on one process (FSDP's shards included) and the launcher started "
        "WORLD_SIZE=2: run it without torchrun or accelerate launch"
    ], result.stderr[-3000:]
    assert not out.exists(), "nothing written"
