"""Credentials kept out of what a model server's answers pass on: its error messages reach
users, API clients, /status and the log, and a server may quote the request's Authorization
header or the key itself in them."""

from __future__ import annotations

import re

REDACTED = "[redacted]"
# "Bearer <token>" in any case, the token up to a space, a quote or punctuation that ends it.
_BEARER = re.compile(r"(?i)\bbearer\s+[^\s'\",;)\]}]+")


def redact_secrets(text: str, key: str | None) -> str:
    """`text` without `key` (wherever it appears) and without any bearer token."""
    if key:
        text = text.replace(key, REDACTED)
    return _BEARER.sub(f"Bearer {REDACTED}", text)
