"""``--push-to-hub``: the repo made (and its token and name checked) before training, the finished run folder uploaded
after; a failed upload keeps the run and says how to upload it later."""

from __future__ import annotations

import shlex
from pathlib import Path

from acceltrain.config.options import ConfigError, first_line
from acceltrain.config.train_config import TrainConfig
from acceltrain.runtime.network import check_reachable

# what a repo gets from the run folder: top-level files only (no checkpoints/, wandb/, logs/, .lock)
HUB_FILES = ["README.md", "*.json", "*.jsonl", "*.safetensors", "*.yaml", "*.txt", "*.png"]


def upload_command(repo_id: str, folder: Path | str) -> str:
    """The CLI line that uploads a run folder as ``--push-to-hub`` does: its top-level files only."""
    return shlex.join(["hf", "upload", repo_id, str(folder), "--exclude", "*/*"])


WITHOUT_PUSH = (
    f"or drop --push-to-hub (the run folder is Hub-ready: upload it later with `{upload_command('REPO', 'RUN_DIR')}`)"
)


def prepare_repo(cfg: TrainConfig, output_dir: Path) -> str:
    """Before training: a token, the Hub online and answering, and the repo created (or already there)
    with write access; returns its id. Every failure is one line."""
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError
    from huggingface_hub.utils import validate_repo_id

    name = cfg.hub_model_id or output_dir.name
    try:
        validate_repo_id(name)
    except HFValidationError as err:
        raise ConfigError(f"--hub-model-id {name!r} is invalid: {first_line(err)}") from None
    if huggingface_hub.is_offline_mode():
        raise ConfigError(f"--push-to-hub cannot work with HF_HUB_OFFLINE set: unset it, {WITHOUT_PUSH}")
    if huggingface_hub.get_token() is None:
        raise ConfigError(
            f"--push-to-hub needs a Hugging Face token with write access: `hf auth login` or HF_TOKEN, {WITHOUT_PUSH}"
        )
    api = huggingface_hub.HfApi()
    check_reachable(api.endpoint, "the Hugging Face Hub", WITHOUT_PUSH.removeprefix("or "))
    try:
        return api.create_repo(name, private=cfg.hub_private or None, exist_ok=True).repo_id
    except HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else None
        if status == 401:
            raise ConfigError(
                f"the Hugging Face Hub at {api.endpoint} rejected the token (check it: `hf auth whoami`), "
                f"{WITHOUT_PUSH}"
            ) from None
        raise ConfigError(
            f"the Hugging Face Hub refused to create repo {name!r} ({status}: {first_line(err, 200)}), {WITHOUT_PUSH}"
        ) from None


def push_folder(repo_id: str, output_dir: Path, summary: dict) -> str:
    """Upload the run folder's top-level files (weights, configs, card, summary, metrics); returns the commit URL."""
    from huggingface_hub import HfApi

    metric = next(
        (f"{k} {summary[k]:.4g}" for k in ("eval_accuracy", "eval_loss") if summary.get(k) is not None), "no eval"
    )
    commit = HfApi().upload_folder(
        repo_id=repo_id,
        folder_path=output_dir,
        allow_patterns=HUB_FILES,
        ignore_patterns=["*/*"],
        commit_message=f"acceltrain run {output_dir.name}: {summary['steps']} steps, {metric}",
    )
    return commit.commit_url
