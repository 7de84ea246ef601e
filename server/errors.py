"""What a client is told when a request goes wrong: one mapping from the engine's error classes
(and pydantic's validation errors) to an HTTP status and a plain message, shared by the
OpenAI-compatible API, the named gradio endpoints and the page's handlers.

The rules: bad input is a 4xx whose message says what to change; a busy or closing server is a
503; anything else is a bug or a device failure, logged with its traceback, and the client
learns only that the server failed (an exception's text can carry paths and internals).
Messages for API clients are plain text; only the page, which renders messages as HTML, gets
them escaped. Guests never see absolute server paths (see `hide_paths`).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import gradio as gr
from pydantic import ValidationError

from model_utils.backends.errors import BackendError
from model_utils.errors import ChatInputError, InvalidParameter, LoadError, ModelBusy, ModelNotFound

from .conversation import ConversationError

log = logging.getLogger("ui")

SERVER_FAILED = "the server failed to handle this request (the details are in its log)"


class ClientError(Exception):
    """An answer for the client: HTTP status, a plain message, the field it is about."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 kind: str | None = None, retry_after: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.retry_after = retry_after  # passed on from a model server (backends.errors)
        self.kind = kind or {401: "authentication_error", 403: "permission_error",
                             429: "rate_limit_error", 503: "server_busy"}.get(
            status, "invalid_request_error" if status < 500 else "server_error")


def models_dir_of(engine) -> Path | None:
    """The folder paths are shown relative to; none in front of a model server (no local
    registry, no local paths)."""
    registry = getattr(engine, "registry", None)
    return getattr(registry, "models_dir", None)


def client_error(error: BaseException, *, context: str = "request") -> ClientError:
    """The one mapping. `context` names what failed, for the log line of a bug."""
    if isinstance(error, ClientError):
        return error
    if isinstance(error, BackendError):  # a model server's refusal or failure, passed on
        return ClientError(error.http_status, str(error), kind=error.kind,
                           retry_after=error.retry_after)
    if isinstance(error, ValidationError):
        return ClientError(400, describe_validation(error), param=_first_field(error))
    if isinstance(error, ModelBusy):  # QueueFull and ShuttingDown too
        return ClientError(503, str(error))
    if isinstance(error, InvalidParameter):
        return ClientError(400, str(error), param=error.name)
    if isinstance(error, ConversationError):
        return ClientError(400, str(error), param="messages")
    if isinstance(error, LoadError) and "no model is loaded" in str(error):
        return ClientError(503, str(error))
    if isinstance(error, (ChatInputError, LoadError, ModelNotFound)):
        return ClientError(400, str(error))
    if isinstance(error, gr.Error):  # a check in a shared helper (admin, load request)
        return ClientError(403 if "only the admin" in error.message else 400,
                           _unescape(error.message))
    log.error("%s failed", context, exc_info=error)
    return ClientError(500, SERVER_FAILED)


def describe_validation(error: ValidationError) -> str:
    """pydantic's errors as one line per field: "messages.0.content: Input should be ..."."""
    lines = []
    for item in error.errors(include_url=False, include_input=False)[:5]:
        where = ".".join(str(part) for part in item["loc"])
        message = item["msg"]
        message = message.removeprefix("Value error, ")
        lines.append(f"{where}: {message}" if where else message)
    return "; ".join(lines)


def _first_field(error: ValidationError) -> str | None:
    errors = error.errors(include_url=False, include_input=False)
    return str(errors[0]["loc"][0]) if errors and errors[0]["loc"] else None


# -- for gradio handlers --------------------------------------------------------------------------
def api_error(error: BaseException, *, full_paths: bool, models_dir: Path | None = None,
              context: str = "request") -> gr.Error:
    """A gr.Error for a named endpoint: its plain message reaches gradio_client as is."""
    mapped = client_error(error, context=context)
    message = mapped.message if full_paths else hide_paths(mapped.message, models_dir)
    return gr.Error(message, print_exception=False)


def page_error(message: str) -> gr.Error:
    """A gr.Error for the page: the browser renders it as HTML, and it may quote what the user
    typed, so "<" and "&" are escaped (">" cannot open markup and stays readable)."""
    return gr.Error(str(message).replace("&", "&amp;").replace("<", "&lt;"),
                    print_exception=False)


def _unescape(message: str) -> str:
    return message.replace("&lt;", "<").replace("&amp;", "&")


# -- server paths ---------------------------------------------------------------------------------
# An absolute path in a message: a "/" at the start or after a space, a quote, "(" or "=" (so
# "Qwen/Qwen3-8B" is a hub id and "<b>x</b>" is not a path), up to a quote, a space or
# punctuation that ends it.
_ABSOLUTE = re.compile(r"(?<![^\s'\"(\[=])/[^\s'\"(),;<>]*")


def shows_full_paths(admin: str | None, user: str | None) -> bool:
    """Who may read the server's absolute paths: the admin, or the one local user of an app
    without logins (loopback only). A logged-in guest sees them relative to the models folder."""
    return user is None or (admin is not None and user == admin)


def client_path(path: str | Path, models_dir: Path | None) -> str:
    """A server path as a guest sees it: relative to the models folder when it lies there,
    else only its last part."""
    path = Path(path)
    if models_dir is not None:
        try:
            relative = str(path.relative_to(models_dir))
            return "the models folder" if relative == "." else relative
        except ValueError:
            pass
    return f"…/{path.name}" if path.name else "…"


def hide_paths(message: str, models_dir: Path | None) -> str:
    return _ABSOLUTE.sub(lambda m: client_path(m.group(0).rstrip(".:"), models_dir)
                         + m.group(0)[len(m.group(0).rstrip(".:")):], message)


def status_for(status: dict, *, full_paths: bool, models_dir: Path | None) -> dict:
    """engine.status() for a client: "path" becomes "model_path" (gradio_client takes any dict
    with a "path" key for a file to download), relative for guests."""
    out = dict(status)
    if "path" in out:
        path = out.pop("path")
        out["model_path"] = path if full_paths else (
            "demo" if out.get("is_demo") else client_path(path, models_dir))
    for key in ("estimate", "decode_path_reason"):
        if not full_paths and isinstance(out.get(key), str):
            out[key] = hide_paths(out[key], models_dir)
    return out
