"""Experiment tracking through Accelerate's trackers (``log_with``, ``init_trackers``, ``log``), with the
W&B rough edges handled: one run for N processes (Accelerate creates it on the main process only), a
name, offline mode instead of a crash when there is no API key, a one-line error within seconds when
online W&B cannot work (server unreachable, credentials rejected) instead of ``wandb.init``'s 90 s wait
and traceback, the same run continued on resume, and the final summary equal to ``summary.json``. The
API key is never read into the config, printed or saved."""

from __future__ import annotations

import functools
import importlib.util
import netrc
import os
import struct
import typing
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

from acceltrain.config.groups import WandbMode
from acceltrain.config.options import ConfigError, first_line, shorten
from acceltrain.config.train_config import TrainConfig
from acceltrain.runtime.network import PROBE_SECONDS, check_reachable

TRACKER_PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboard"}


def tracker_names(report_to: str) -> list[str]:
    if report_to == "none":
        return []
    if report_to == "all":
        return list(TRACKER_PACKAGES)
    return [report_to]


def active_trackers(cfg: TrainConfig) -> list[str]:
    """The trackers to start: ``--report-to`` less W&B when its mode resolves to disabled. Checks that
    each is installed, before anything heavy happens."""
    names = [n for n in tracker_names(cfg.report_to) if not (n == "wandb" and wandb_mode(cfg) == "disabled")]
    for name in names:
        if importlib.util.find_spec(TRACKER_PACKAGES[name]) is None:
            raise ConfigError(
                f"--report-to {cfg.report_to} needs the {TRACKER_PACKAGES[name]!r} package: pip install "
                f"{TRACKER_PACKAGES[name]}"
            )
    if "wandb" in names:
        check_wandb_dir()
    # the main process alone talks to W&B; the others learn of its failure from the launcher
    if "wandb" in names and wandb_mode(cfg) == "online" and os.environ.get("RANK", "0") == "0":
        check_wandb_online()
    return names


OFFLINE_WAYS = "run with --wandb-mode offline (upload later with wandb sync) or --report-to none"


def check_wandb_online() -> None:
    """Fail in seconds, with one line, where ``wandb.init`` would wait 90 s and raise a CommError: the
    server (wandb's resolved base URL) does not answer, or rejects the credentials (checked by
    ``wandb.Api``, which finds them where wandb does)."""
    import wandb

    _check_wandb_online(wandb.setup().settings.base_url)


@functools.cache  # one probe per process and server: fit() and an earlier caller need not both wait
def _check_wandb_online(base_url: str) -> None:
    import wandb

    check_reachable(base_url, "W&B", OFFLINE_WAYS)  # first: wandb reports "unreachable" and "rejected" alike
    try:
        wandb.Api(timeout=PROBE_SECONDS)
    except wandb.errors.AuthenticationError as err:
        reason = first_line(err).removeprefix(f"Failed to verify credentials with {base_url}: ")
        raise ConfigError(
            f"W&B at {base_url} rejected {_credentials_source()} ({reason[:200]}); check it (wandb login --relogin), "
            f"or {OFFLINE_WAYS}"
        ) from None
    except wandb.errors.UsageError as err:  # --wandb-mode online without any credentials
        raise ConfigError(
            f"W&B online needs credentials ({first_line(err, 200)}); set WANDB_API_KEY, or {OFFLINE_WAYS}"
        ) from None


def _credentials_source() -> str:
    if os.environ.get("WANDB_API_KEY"):
        return "the API key in $WANDB_API_KEY"
    if os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return "the identity token in $WANDB_IDENTITY_TOKEN_FILE"
    return "the API key saved by `wandb login`"


def wandb_credentials_present() -> bool:
    """An API key in the environment, an identity token file, or a ~/.netrc entry for the W&B host
    (where ``wandb login`` writes). Only presence is checked; the key itself is never read."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    import wandb

    host = urlparse(os.environ.get("WANDB_BASE_URL") or wandb.Settings().base_url).hostname  # wandb's default host
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode(cfg: TrainConfig) -> str:
    """``--wandb-mode``, else ``$WANDB_MODE``, else online with credentials and offline without. wandb.init reads
    ``$WANDB_MODE`` even when given a mode, and a value it does not know is a ValidationError at the first step:
    here an empty one counts as unset (a shell's ``WANDB_MODE=``; removed, as wandb would refuse it), and a value
    other than --wandb-mode's choices and wandb's older ``dryrun`` is refused, before training."""
    if cfg.wandb_mode == "disabled":
        return "disabled"  # wandb is not started: its variables do not matter
    env = os.environ.get("WANDB_MODE")
    allowed = typing.get_args(WandbMode)
    if env == "":
        del os.environ["WANDB_MODE"]
    elif env is not None and env not in (*allowed, "dryrun"):
        raise ConfigError(
            f"WANDB_MODE={shorten(env)} is invalid: must be one of {', '.join(allowed)} (as --wandb-mode), or empty "
            "for unset"
        )
    mode = cfg.wandb_mode or env
    if mode == "dryrun":
        return "offline"
    return mode or ("online" if wandb_credentials_present() else "offline")


def check_wandb_dir() -> None:
    """``$WANDB_DIR`` (where wandb writes its ``wandb/`` folder) must be a folder there is or can be: wandb.init
    puts the run into /tmp/wandb without a word when it cannot (a file on the path, no write permission)."""
    folder = os.environ.get("WANDB_DIR")
    if not folder:
        return
    path = Path(folder).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"WANDB_DIR={shorten(folder, 200)} cannot be a folder: {shorten(str(existing), 200)} is "
            f"{'not writable' if existing.is_dir() else 'not a folder'}; point it at a writable folder, or "
            "unset it for <output-dir>/wandb"
        )


def start_tracking(
    accelerator,
    cfg: TrainConfig,
    names: list[str],
    *,
    run_name: str,
    output_dir: Path,
    run_config: dict,
    resume_run_id: str | None,
) -> str | None:
    """Start the trackers' run on the main process; returns the W&B run id (to save in checkpoints)."""
    if not names:
        return None
    project = cfg.wandb_project or os.environ.get("WANDB_PROJECT") or "acceltrain"
    wandb_dir = os.environ.get("WANDB_DIR") or str(output_dir)  # W&B users point $WANDB_DIR at scratch space
    wandb_kwargs = {"name": run_name, "dir": wandb_dir, "mode": wandb_mode(cfg)}
    if cfg.wandb_group:
        wandb_kwargs["group"] = cfg.wandb_group
    if cfg.wandb_tags:
        wandb_kwargs["tags"] = [tag.strip() for tag in cfg.wandb_tags.split(",") if tag.strip()]
    if cfg.wandb_notes:
        wandb_kwargs["notes"] = cfg.wandb_notes
    if resume_run_id:
        wandb_kwargs.update(id=resume_run_id, resume="allow")
    if "wandb" in names and cfg.log_level != "debug":  # wandb's own banner and summary: the log says what matters
        import wandb

        wandb_kwargs["settings"] = wandb.Settings(silent=True)
    accelerator.init_trackers(project, config=_flat_scalars(run_config), init_kwargs={"wandb": wandb_kwargs})
    if "wandb" not in names or not accelerator.is_main_process:
        return None
    run = accelerator.get_tracker("wandb", unwrap=True)
    from accelerate.logging import get_logger  # here: run_recipe imports this module before torch, to check trackers

    if wandb_kwargs["mode"] == "offline":
        why = (
            ""
            if cfg.wandb_mode or os.environ.get("WANDB_MODE")
            else "no W&B API key found (WANDB_API_KEY or `wandb login`), so "
        )
        get_logger(__name__).info(f"W&B: {why}logging offline; upload later with: wandb sync {run.settings.sync_dir}")
    else:
        get_logger(__name__).info(f"W&B: {run.url}")
    return run.id


def finish_tracking(
    accelerator, names: list[str], summary: dict, weights: Path, log_model: bool, extra_files=()
) -> None:
    """Make the W&B run summary equal ``summary.json``, attach the weights if asked and ``extra_files``
    (the profiler's trace and tables). ``Accelerator.end_training`` closes the run afterwards."""
    if "wandb" in names and accelerator.is_main_process:
        run = accelerator.get_tracker("wandb", unwrap=True)
        run.log({}, commit=True)  # flush the last step's row first: its auto-summary would overwrite ours
        run.summary.update(summary)
        for file in extra_files:
            run.save(str(file), base_path=str(weights.parent), policy="now")
        if log_model:
            import wandb

            artifact = wandb.Artifact(f"model-{run.id}", type="model", metadata={"steps": summary["steps"]})
            artifact.add_file(str(weights))
            run.log_artifact(artifact)


def _flat_scalars(config: dict, prefix: str = "") -> dict:
    """Trackers (TensorBoard's hparams in particular) take scalars only: flatten and stringify the rest."""
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flat_scalars(value, prefix=f"{name}."))
        elif value is None or isinstance(value, (bool, int, float, str)):
            flat[name] = value if value is not None else "None"
        else:
            flat[name] = str(value)
    return flat


# --------------------------------------------------------------------------- reading offline runs

_BLOCK, _HEADER = 32768, 7


def wandb_records(path: Path) -> Iterator:
    """The protobuf records of a ``run-*.wandb`` file, parsed with wandb's own ``Record`` message.
    The file is a LevelDB-style log: a 7-byte file header, then 32 KiB blocks of (checksum, length,
    type) framed chunks; type 1 is a whole record, 2/3/4 its first/middle/last parts."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file")
    position, pending = _HEADER, b""
    while position + _HEADER <= len(data):
        left_in_block = _BLOCK - position % _BLOCK
        if left_in_block < _HEADER:
            position += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + _HEADER])
        if length == 0 and kind == 0:  # block padding
            position += left_in_block
            continue
        chunk = data[position + _HEADER : position + _HEADER + length]
        position += _HEADER + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def read_offline_run(run_dir: Path) -> dict:
    """Run id, config, history rows (by step), summary and artifact names of an offline W&B run folder."""
    import json

    (run_file,) = Path(run_dir).glob("run-*.wandb")
    out = {"id": None, "name": None, "config": {}, "history": [], "summary": {}, "artifacts": []}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["id"], out["name"] = record.run.run_id, record.run.display_name
            for item in record.run.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            out["history"].append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
        elif kind == "summary":
            for item in record.summary.update:
                out["summary"][item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind == "artifact":
            out["artifacts"].append(record.artifact.name)
    return out
