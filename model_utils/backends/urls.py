"""A model server's address: checked, and shown without credentials (no heavy imports: app.py
uses these before anything else is loaded)."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def normalize_url(url: str) -> str:
    """An http(s) base URL without a trailing slash; "/v1" added when no path is given (vLLM,
    SGLang and this app all serve the API there). ValueError for anything else."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http(s) URL such as http://gpu-node:8000/v1, got "
                         f"{redact(url)!r}")
    path = parts.path.rstrip("/") or "/v1"
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def redact(url: str) -> str:
    """The URL without user:password@ and query: what may be logged and shown."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = host + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))
