"""What a model server's /models entry says of a model: the name to show, its context."""

from __future__ import annotations

from pathlib import PurePosixPath


def shown_name(model_id: str) -> str:
    """A model's name as shown and as this app's /v1/models gives it: the server's id, but of
    an id that is a folder of the server (vLLM serving a path) only its last part."""
    return PurePosixPath(model_id).name if model_id.startswith("/") else model_id


def context_of(entry: dict | None) -> int | None:
    """The model's context window as its /models entry gives it (vLLM's, SGLang's and this
    app's max_model_len; context_length elsewhere)."""
    for key in ("max_model_len", "context_length"):
        value = (entry or {}).get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
