"""The checkpoint matrix's recipe (tests/test_checkpoint_matrix.py): one small model of each kind a checkpoint must
get right, on data made here, and the three ways a run stops.

--kind cnn:  a conv net with BatchNorm (buffers that every training forward changes) on synthetic images;
--kind lm:   a 1-layer GPT-2 whose input and output embeddings are one tied tensor, on random token blocks;
--kind lora: a LoRA adapter (peft) on a tiny BERT classifier whose frozen base is the folder --base.
--peaking-metric: the evaluations' primary metric peaks at the second (--load-best-at-end's tests).

Stops: --stop-after-steps N (built in); --sigterm-at N (every process sends itself SIGTERM after step N, as a
scheduler's signal to the job would); --die-mid-save N (every process SIGKILLs itself inside the save of step N,
after some of its files are written: with --async-checkpoint, in the writer thread)."""

import os
import signal
from dataclasses import dataclass

import torch
from torch import nn

from acceltrain import (
    ClassificationTask,
    Hook,
    LoraOptions,
    TrainConfig,
    apply_lora,
    build_optimizer,
    fit,
    option,
    run_recipe,
)
from acceltrain.vision import ImageClassification, synthetic_images

VOCAB, BLOCK = 64, 8


@dataclass
class MatrixConfig(LoraOptions, TrainConfig):
    plots: bool = option(  # drawing costs a second a launch; tests/test_plots.py checks the picture
        False, "draw <output_dir>/curves.png when each launch ends", free_on_resume=True
    )
    kind: str = option("cnn", "the model", choices=("cnn", "lm", "lora"))
    base: str | None = option(None, "--kind lora: the base model's folder")
    sigterm_at: int | None = option(None, "every process sends itself SIGTERM after this step", free_on_resume=True)
    die_mid_save: int | None = option(
        None, "every process SIGKILLs itself inside the save of this step", free_on_resume=True
    )
    peaking_metric: bool = option(
        False, "the primary metric of the evaluations is 0.1, 0.5, 0.3, 0.2, ...: best at the 2nd"
    )


PEAK = (0.1, 0.5, 0.3, 0.2)


def peaking(task):
    """``task`` with its primary metric replaced by :data:`PEAK`, evaluation by evaluation (the other metrics kept)."""
    metrics, evaluations = task.eval_metrics, [0]

    def eval_metrics(sums, samples):
        values = dict(metrics(sums, samples))
        values[task.primary_metric] = PEAK[min(evaluations[0], len(PEAK) - 1)]
        evaluations[0] += 1
        return values

    task.primary_metric, task.higher_is_better, task.eval_metrics = "accuracy", True, eval_metrics
    return task


class SigtermAt(Hook):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, run):
        if run.step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def die_inside_the_save_of(step: int) -> None:
    """Wrap what writes a checkpoint's files: in the save of ``step`` the process dies once some are on disk."""
    from acceltrain.checkpoint import manager, writers

    def dying(write):
        def wrapped(*args, **kwargs):
            result = write(*args, **kwargs)
            if f"step_{step:08d}" in str(args[1] if len(args) > 1 else args[0]):
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        return wrapped

    manager.save_loop_state = dying(manager.save_loop_state)  # (accelerator, folder): every process, every engine
    writers.write_part = dying(
        writers.write_part
    )  # (part, folder): the model and optimizer files, in the writer thread


class TokenBlocks(torch.utils.data.Dataset):
    def __init__(self, count: int, seed: int):
        self.blocks = torch.randint(0, VOCAB, (count, BLOCK), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, index):
        return self.blocks[index]


class NextToken(ClassificationTask):
    """The mean next-token loss of a block (a mean, not a sum: it trains under DeepSpeed too)."""

    primary_metric, higher_is_better = "loss", False

    def train_loss(self, model, batch):
        return model(input_ids=batch, labels=batch).loss

    def eval_values(self, model, batch):
        logits = model(input_ids=batch).logits[:, :-1]
        losses = nn.functional.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none").mean(dim=1)
        return {"loss": losses}


class Sentences(torch.utils.data.Dataset):
    """Token ids labelled by whether token 7 occurs: learnable by a classifier in a few steps."""

    def __init__(self, count: int, seed: int):
        self.ids = torch.randint(5, 40, (count, BLOCK), generator=torch.Generator().manual_seed(seed))
        self.labels = (self.ids == 7).any(dim=1).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.labels[index]}


class SentenceTask(ClassificationTask):
    def train_loss(self, model, batch):
        return model(**batch).loss

    def eval_values(self, model, batch):
        logits = model(input_ids=batch["input_ids"]).logits
        return {
            "loss": nn.functional.cross_entropy(logits, batch["labels"], reduction="none"),
            "accuracy": (logits.argmax(dim=1) == batch["labels"]).float(),
        }


def build(cfg: MatrixConfig):
    """(model, train set, eval set, task) of ``cfg.kind``."""
    torch.manual_seed(cfg.seed)
    if cfg.kind == "cnn":
        (x, y), (x_eval, y_eval) = synthetic_images(64, 16, seed=cfg.seed)
        classes = [str(i) for i in range(10)]
        model = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, 10),
        )
        return (
            model,
            ImageClassification(x, y, classes),
            ImageClassification(x_eval, y_eval, classes),
            ClassificationTask(),
        )
    if cfg.kind == "lm":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=VOCAB,
            n_positions=BLOCK,
            n_embd=16,
            n_layer=1,
            n_head=2,
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        model = GPT2LMHeadModel(config)
        assert model.lm_head.weight is model.transformer.wte.weight, "tied"
        return model, TokenBlocks(64, cfg.seed), TokenBlocks(16, cfg.seed + 1), NextToken()
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(cfg.base, num_labels=2)
    return apply_lora(model, cfg), Sentences(64, cfg.seed), Sentences(16, cfg.seed + 1), SentenceTask()


def main(cfg: MatrixConfig) -> dict:
    if cfg.die_mid_save is not None:
        die_inside_the_save_of(cfg.die_mid_save)
    model, train_set, eval_set, task = build(cfg)
    task = peaking(task) if cfg.peaking_metric else task
    hooks = [SigtermAt(cfg.sigterm_at)] if cfg.sigterm_at is not None else []
    return fit(cfg, model, build_optimizer(model, cfg), train_set, eval_set, task=task, hooks=hooks, name="matrix")


if __name__ == "__main__":
    run_recipe(main, MatrixConfig)
