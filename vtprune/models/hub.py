"""The Hugging Face hub as the loader meets it: offline mode, the local cache, and a fast reachability probe.

``from_pretrained`` on a machine without network retries each file five times (about 50 s) before it says
that it could not connect. :func:`hub_access` answers in at most a few seconds, before any weight is read:
a cached model loads with ``local_files_only=True`` when the hub cannot be reached, and a model that is
neither cached nor reachable is refused with one line that names the fix. No torch or transformers here.
"""

from __future__ import annotations

import functools
import os
import socket
from urllib.parse import urlparse

from vtprune.errors import UserError

DEFAULT_ENDPOINT = "https://huggingface.co"
PROBE_SECONDS = 3.0


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` is set to a true word (the hub is never contacted)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def cached(repo_id: str) -> bool:
    """The hub id has a ``config.json`` in the local Hugging Face cache."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def endpoint() -> str:
    """The hub address in use (``HF_ENDPOINT`` or huggingface.co)."""
    return os.environ.get("HF_ENDPOINT", "").strip() or DEFAULT_ENDPOINT


@functools.lru_cache(maxsize=8)
def _probe(url: str, proxy: str, timeout: float) -> str | None:
    """None when a TCP connection to the hub (or to the HTTPS proxy) opens within ``timeout``, else why not."""
    target = urlparse(proxy or url)
    host = target.hostname or ""
    port = target.port or (443 if target.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except socket.gaierror as error:
        return f"cannot resolve {host} ({error.strerror or error})"
    except TimeoutError:
        return f"no answer from {host}:{port} within {timeout:g} s"
    except OSError as error:
        return f"cannot connect to {host}:{port} ({error.strerror or error})"


def hub_unreachable(timeout: float = PROBE_SECONDS) -> str | None:
    """Why the hub cannot be reached from here (DNS, refused, timed out), or None when it answers.

    The probe opens one TCP connection to the endpoint, or to the ``HTTPS_PROXY`` when one is set; the
    answer is remembered for the process, so several checks cost one probe.
    """
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy") or ""
    return _probe(endpoint(), proxy, timeout)


def hub_access(repo_id: str, flag: str = "--model") -> bool:
    """How to load hub id ``repo_id``: True means from the local cache only (``local_files_only=True``).

    Offline (``HF_HUB_OFFLINE=1``) or unreachable hub: the cached copy, or a :class:`UserError` when there is
    none. Reachable hub: False (download or refresh as ``from_pretrained`` does).
    """
    if hub_offline():
        if not cached(repo_id):
            raise UserError(f"{flag} {repo_id!r} is not in the local Hugging Face cache and the hub is offline "
                            "(HF_HUB_OFFLINE=1); download it first (unset HF_HUB_OFFLINE) or give a local folder.")
        return True
    reason = hub_unreachable()
    if reason is None:
        return False
    if cached(repo_id):
        return True
    raise UserError(f"{flag} {repo_id!r}: the Hugging Face hub ({endpoint()}) cannot be reached: {reason}, and "
                    "the model is not in the local cache. Check the network (or HF_ENDPOINT / HTTPS_PROXY), or "
                    "download it on a machine that can reach the hub and give its folder.")
