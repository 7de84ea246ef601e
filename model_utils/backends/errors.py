"""What can go wrong talking to a model server, as errors a user can act on.

Each carries the HTTP status this app answers its own API clients with, and the Retry-After to
pass on. They are LoadErrors ("no model can answer now"), so the page and the gradio endpoints
show their message as they show any refused reply, without a traceback. The messages say "the
model server", never its address: users of this app need not know where it runs.
"""

from __future__ import annotations

import json
import re

from model_utils.errors import LoadError

# The extensions to the OpenAI chat API that vLLM and SGLang accept and others may refuse.
EXTENSIONS = ("top_k", "repetition_penalty", "chat_template_kwargs")
_MENTIONS = {"top_k": ("top_k",), "repetition_penalty": ("repetition_penalty",),
             "chat_template_kwargs": ("chat_template_kwargs", "enable_thinking")}


class BackendError(LoadError):
    http_status = 502  # bad gateway: the server behind this app failed
    kind = "backend_error"

    def __init__(self, message: str, *, retry_after: str | None = None,
                 http_status: int | None = None):
        super().__init__(message)
        self.retry_after = retry_after
        if http_status is not None:
            self.http_status = http_status


class BackendUnavailable(BackendError):
    """Not reachable, or it hung up: try again once it is back."""

    http_status = 503
    kind = "backend_unavailable"

    def __init__(self, message: str, *, retry_after: str | None = "5"):
        super().__init__(message, retry_after=retry_after)


class BackendBusy(BackendError):
    """429 or 503 from the server, or this app's own limit of replies in flight."""

    kind = "server_busy"


class BackendTimeout(BackendError):
    http_status = 504
    kind = "backend_timeout"


class BackendRejected(BackendError):
    """The server refused the request itself (HTTP 400/422); `extensions` are the non-standard
    fields its message names, which a retry without them may get past."""

    http_status = 400
    kind = "invalid_request_error"

    def __init__(self, message: str, extensions: tuple[str, ...] = ()):
        super().__init__(message)
        self.extensions = extensions


class MalformedStream(BackendError):
    """A reply that is not the server-sent events of the OpenAI API."""


def server_message(body: bytes | str) -> str:
    """The message of an error body ({"error": {"message"}}, {"detail"}, or plain text), made
    safe to show: one line, bounded, no markup."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        error = data.get("error", data.get("detail", data.get("message")))
        if isinstance(error, dict):
            error = error.get("message", error)
        text = error if isinstance(error, str) else json.dumps(error)
    elif "<html" in text.lower():
        return ""  # a proxy's error page says nothing the status code does not
    return re.sub(r"\s+", " ", str(text)).strip()[:300]


def error_for_status(status: int, body: bytes, retry_after: str | None) -> BackendError:
    message = server_message(body)
    said = f": {message}" if message else ""
    if status in (401, 403):
        return BackendError(
            f"the model server refused this app's credentials (HTTP {status}); the operator "
            "must check --backend-key / --backend-key-file")
    if status == 429:
        return BackendBusy(f"the model server is at its request limit (HTTP 429): try again "
                           f"in {retry_after or 1} s", retry_after=retry_after or "1",
                           http_status=429)
    if status == 503:
        return BackendBusy(f"the model server is busy or starting (HTTP 503): try again in "
                           f"{retry_after or 1} s{said}", retry_after=retry_after or "1",
                           http_status=503)
    if status in (408, 504):
        return BackendTimeout(f"the model server timed out (HTTP {status}){said}")
    if status in (400, 422):
        named = tuple(name for name in EXTENSIONS
                      if any(word in message for word in _MENTIONS[name]))
        return BackendRejected(f"the model server refused the request{said}", named)
    if status == 404:
        return BackendError(f"the model server has no such model or endpoint (HTTP 404){said}")
    return BackendError(f"the model server failed (HTTP {status}){said}")
