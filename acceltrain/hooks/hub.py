"""Every finished run folder Hub-ready (``config.json``, model card, ``train_config.yaml``; see
:mod:`acceltrain.hf.hub`), and ``--push-to-hub``: the repo checked and created before the first step,
the folder uploaded at the end. A model whose folder could not be written as its ecosystem loads it (a
Transformers model whose weights do not fit its own config, an adapter under DeepSpeed) is refused before
training; the parameter counts (trained, total) go into the summary. From a launch's first save on, the
model's config (and a LoRA adapter's ``adapter_config.json``) is beside the checkpoints too, for
``acceltrain merge`` of a run that stops early."""

from __future__ import annotations

from accelerate.logging import get_logger

from acceltrain.config.groups import HubOptions
from acceltrain.config.options import first_line
from acceltrain.engines import engine_of
from acceltrain.hf.hub import (
    check_fits_own_config,
    describe_checkpoints,
    is_transformers_model,
    write_model_files,
)
from acceltrain.hf.lora import check_backend, is_peft_model, merge_requested, parameter_counts
from acceltrain.hf.model_card import model_card, write_train_config
from acceltrain.hf.upload import prepare_repo, push_folder, upload_command
from acceltrain.hooks.base import Hook
from acceltrain.runtime.distributed import main_process_only
from acceltrain.runtime.run_folder import CARD_FILE, write_summary

logger = get_logger(__name__)


class HubReady(Hook):
    """Runs last among the built-in hooks, so that the card and the upload see every summary entry."""

    def __init__(self, push: bool):
        self.push = push
        self.repo_id: str | None = None
        self.parameters: dict[str, int] = {}
        self.described = False  # this launch wrote the model's description beside the checkpoints

    @classmethod
    def from_config(cls, cfg: HubOptions) -> HubReady:
        return cls(push=cfg.push_to_hub)

    def on_fit_start(self, run) -> None:
        model = run.accelerator.unwrap_model(run.model)
        if is_peft_model(model):
            check_backend(engine_of(run.accelerator), merge=merge_requested(model))
        elif is_transformers_model(model):
            check_fits_own_config(model)
        trainable, total = parameter_counts(model)
        self.parameters = {"trainable_parameters": trainable, "parameters": total}
        if not self.push:
            return

        def prepare() -> None:  # on the main process; its one-line error stops every process
            self.repo_id = prepare_repo(run.cfg, run.output_dir)

        main_process_only(prepare)

    def on_save(self, run, folder) -> None:
        if not self.described and run.accelerator.is_main_process:
            describe_checkpoints(run.accelerator.unwrap_model(run.model), folder.parent)
        self.described = True

    def on_fit_end(self, run, summary: dict) -> None:
        summary.update(self.parameters)
        if not run.accelerator.is_main_process:
            return
        model = run.accelerator.unwrap_model(run.model)
        if is_peft_model(model) and merge_requested(model):
            model = model.get_base_model()  # merged into by the export: the folder holds it
        pipeline_tag = write_model_files(model, run.output_dir)
        write_train_config(run.cfg, run.output_dir)
        (run.output_dir / CARD_FILE).write_text(model_card(run, model, summary, pipeline_tag, self.repo_id))
        if self.repo_id is None:
            return
        write_summary(run.output_dir, summary)  # the loop writes it after the hooks; the upload needs it now
        try:
            summary["hub_commit"] = push_folder(self.repo_id, run.output_dir, summary)
        except Exception as err:  # noqa: BLE001 - the trained run stays finished and on disk; said in one line
            reason = first_line(err)
            summary["hub_push_error"] = reason if reason == type(err).__name__ else f"{type(err).__name__}: {reason}"
            logger.warning(
                f"--push-to-hub: the upload to {self.repo_id} failed ({summary['hub_push_error']}); the run is "
                f"complete in {run.output_dir}: upload it with `{upload_command(self.repo_id, run.output_dir)}`"
            )
        else:
            logger.info(f"pushed {run.output_dir} to the Hub: {summary['hub_commit']}")
