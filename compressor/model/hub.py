"""Whether a hub id can be fetched: offline settings, the hub's reachability, the local cache.

What loading a model or its tokenizer asks before the hub client's own retries (about 40 s) would start.
"""

from __future__ import annotations

import functools
import os
import socket
import threading

from ..errors import UserError


def _offline_env() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


@functools.lru_cache(maxsize=8)
def hub_unreachable(endpoint: str, timeout: float = 3.0) -> str | None:
    """Why ``endpoint`` (the hub's URL) cannot be reached within ``timeout`` seconds, or None."""
    from urllib.parse import urlparse

    u = urlparse(endpoint)
    host = u.hostname or "huggingface.co"
    port = u.port or (80 if u.scheme == "http" else 443)
    box: dict = {}

    def resolve() -> None:
        try:
            box["addr"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as e:
            box["err"] = e

    t = threading.Thread(target=resolve, daemon=True)  # getaddrinfo has no timeout of its own
    t.start()
    t.join(timeout)
    if "addr" not in box:
        e = box.get("err")
        return f"{host} does not resolve" + (f": {e.strerror or e}" if e else f" within {timeout:.0f} s")
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        return f"no connection to {host}:{port} ({e.strerror or type(e).__name__})"
    return None


def _cached(repo: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo, "config.json"), str)
    except Exception:  # noqa: BLE001 - a malformed id or cache: not cached
        return False


def hub_local_only(source: str, what: str = "MODEL") -> bool:
    """For a hub id: True when it must come from the local cache (offline); UserError at once when it
    cannot come from anywhere, instead of the hub client's retries."""
    if _offline_env():
        if _cached(source):
            return True
        raise UserError(f"{what}: {source} is no local path and not in the Hugging Face cache, and HF_HUB_OFFLINE "
                        "is set; give a model folder or a .gguf file")
    reason = hub_unreachable(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    if reason is None:
        return False
    if _cached(source):
        return True
    raise UserError(f"{what}: {source} is no local path and the Hugging Face hub is unreachable ({reason}); "
                    "give a model folder or a .gguf file")
