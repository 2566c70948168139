"""The services a run talks to (W&B, the Hugging Face Hub): their reachability, checked within seconds before
training: their own clients wait far longer when a server does not answer (``wandb.init`` 90 s and
retries; huggingface_hub's API calls have no timeout at all)."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from acceltrain.config.options import ConfigError

PROBE_SECONDS = 5


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is an answer: the server is there, wherever it points."""

    def redirect_request(self, *args, **kwargs):
        return None


def check_reachable(url: str, service: str, ways_out: str) -> None:
    """ConfigError unless ``url`` gives any HTTP answer within ``PROBE_SECONDS`` (a 401 or 404 counts)."""
    try:
        urllib.request.build_opener(_NoRedirect).open(url, timeout=PROBE_SECONDS).close()
    except urllib.error.HTTPError:
        return
    except (OSError, ValueError) as err:  # URLError, timeouts, refused connections; ValueError: not a URL
        reason = getattr(err, "reason", None) or err
        raise ConfigError(
            f"{service} at {url} is unreachable ({reason} within {PROBE_SECONDS} s); {ways_out}"
        ) from None


def load_local_or_hub(loader: Callable, source: str, flag: str, what: str):
    """``loader(source)`` for a local folder or a Hub name; a one-line ConfigError naming ``flag`` when
    it fails (offline, a typo, a folder without the files)."""
    path = Path(source).expanduser()
    local = path.is_dir()
    if not local and (source.startswith((".", "/", "~")) or source.count("/") > 1):  # a path, not "org/name"
        raise ConfigError(f"{flag} {source!r}: no such file or folder")
    try:
        return loader(str(path) if local else source)
    except (OSError, ValueError, KeyError) as err:
        where = "the local folder" if local else "the Hugging Face Hub (offline? pass a local folder instead)"
        raise ConfigError(f"{flag} {source!r}: could not load {what} from {where}: {one_line(err)}") from None


def one_line(err: BaseException, limit: int = 200) -> str:
    """A library's error message on one line, shortened: enough to say why, never a wall of text."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
