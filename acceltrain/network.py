"""Reachability of the services a run talks to (W&B, the Hugging Face Hub), checked within seconds before
training: their own clients wait far longer when a server does not answer (``wandb.init`` 90 s and
retries; huggingface_hub's API calls have no timeout at all)."""

from __future__ import annotations

import urllib.error
import urllib.request

from .options import ConfigError

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
        raise ConfigError(f"{service} at {url} is unreachable ({reason} within {PROBE_SECONDS} s); {ways_out}") from None
