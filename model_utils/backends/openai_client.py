"""The OpenAI chat API as a client: the model list, the request body, and the streamed reply
parsed from server-sent events. No policy here (retries, notices, stats): remote.py has that.

Every wait is bounded: connect (reaching the server), pool (a free connection), httpx's read
timeout (a socket silent that long), and, within a streamed reply, stream_watch.StreamWatch's
reply deadline and idle timeout (no complete line for the read timeout), which hold even while
the server trickles a line byte by byte. Every size is bounded too (sse.py), and what the
server says is passed on without this app's key (redaction.py).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from .answer_deadline import AnswerDeadline
from .errors import (
    BackendBusy,
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    MalformedStream,
    error_for_status,
)
from .redaction import redact_secrets
from .sse import (
    MAX_MODELS_BODY_BYTES,
    LineSplitter,
    check_identity,
    parse_event,
    read_capped,
    read_head,
    without_surrogates,
)
from .stream_watch import HeaderWatch, StreamWatch
from .urls import redact

# The health check's whole /models answer, however the server sends it: a server that takes
# longer is down for the check (replies do not wait for it).
MODELS_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ServerConfig:
    base_url: str  # ".../v1"
    key: str | None = None
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 120.0
    reply_timeout_s: float = 1800.0

    @property
    def shown_url(self) -> str:
        return redact(self.base_url)


def make_client(config: ServerConfig, connections: int, *,
                keep_alive: bool = True) -> httpx.Client:
    """keep_alive False: every request on a new connection (the streamed replies: their
    header watch needs the socket, which only a new connection announces)."""
    # identity: bodies are bounded as read (sse.py), which a compressed one would defeat.
    headers = {"Accept-Encoding": "identity"}
    if config.key:
        headers["Authorization"] = f"Bearer {config.key}"
    timeout = httpx.Timeout(connect=config.connect_timeout_s, read=config.read_timeout_s,
                            write=config.read_timeout_s, pool=config.connect_timeout_s)
    # Idle connections are let go after 2 s, before the server's own keep-alive timeout
    # (uvicorn's, under vLLM and this app: 5 s) can close one just as a request goes out.
    limits = httpx.Limits(max_connections=connections,
                          max_keepalive_connections=connections if keep_alive else 0,
                          keepalive_expiry=2.0)
    # trust_env off: a proxy set for the rest of the machine is not the way to the cluster.
    return httpx.Client(base_url=config.base_url, headers=headers, timeout=timeout,
                        limits=limits, trust_env=False)


def translate(error: httpx.HTTPError, config: ServerConfig) -> BackendError:
    """An httpx failure -> the user's message (the address goes to the log, not to users)."""
    if isinstance(error, httpx.PoolTimeout):
        return BackendBusy("every connection to the model server is in use: try again shortly",
                           retry_after="1", http_status=503)
    if isinstance(error, httpx.ConnectTimeout):
        return BackendUnavailable(f"the model server did not accept a connection within "
                                  f"{config.connect_timeout_s:g} s; this app keeps retrying")
    if isinstance(error, httpx.ConnectError):
        return BackendUnavailable("the model server is not reachable (connection refused or "
                                  "no route); this app keeps retrying")
    if isinstance(error, httpx.ReadTimeout):
        return BackendTimeout(f"the model server sent nothing for {config.read_timeout_s:g} s")
    if isinstance(error, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
        return BackendUnavailable("the model server closed the connection")
    return BackendError(f"talking to the model server failed ({type(error).__name__})")


def list_models(client: httpx.Client, config: ServerConfig,
                timeout_s: float = MODELS_TIMEOUT_S) -> list[dict]:
    """GET /models -> [{"id", "max_model_len"?...}], the whole answer within `timeout_s`
    (`client`: one whose connections are not kept alive, see answer_deadline.py)."""
    deadline = AnswerDeadline(timeout_s)
    try:
        with deadline, client.stream("GET", "/models",
                                     extensions={"trace": deadline.trace}) as response:
            if response.status_code != 200:
                raise error_for_status(response.status_code, read_head(response),
                                       response.headers.get("retry-after"))
            body = read_capped(response, MAX_MODELS_BODY_BYTES, what="/models answer")
    except httpx.HTTPError as error:
        if deadline.expired:
            raise BackendTimeout(f"the model server's /models answer took longer than "
                                 f"{timeout_s:g} s") from None
        raise translate(error, config) from error
    except BackendError as error:
        raise redacted(error, config) from None
    try:
        data = without_surrogates(json.loads(body))["data"]
        return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
    except (ValueError, KeyError, TypeError):
        raise MalformedStream("the model server's /models answer is not an OpenAI model "
                              "list") from None


def redacted(error: BackendError, config: ServerConfig) -> BackendError:
    """The same error, its message without the key or a bearer token (it quotes the
    server, and goes to users and the log)."""
    error.args = (redact_secrets(str(error), config.key), *error.args[1:])
    return error


def request_body(model: str, messages: list[dict], options: dict, thinking: bool, *,
                 leave_out: set[str] = frozenset()) -> dict:
    """The chat request. `options`: the user's settings by their OpenAI names (standard and
    extension); the extensions in `leave_out` (refused by this server) are not sent."""
    body = {"model": model, "messages": messages, "stream": True,
            "stream_options": {"include_usage": True}}
    body.update({k: v for k, v in options.items() if k not in leave_out})
    if "chat_template_kwargs" not in leave_out:
        # Qwen3's switch, as vLLM and SGLang take it (this app too); other templates ignore it.
        body["chat_template_kwargs"] = {"enable_thinking": bool(thinking)}
    return body


def stream_chunks(client: httpx.Client, config: ServerConfig, body: dict,
                  stop: threading.Event, deadline: float) -> Iterator[dict]:
    """POST /chat/completions and yield each event's JSON until [DONE] or the stream ends.
    Ends early, closing the connection (the server frees the reply's place), when `stop` is
    set, the deadline passes or no line comes for the read timeout (BackendTimeout, even
    mid-line), a line is too long (MalformedStream), or the consumer closes this generator."""
    watch = None
    headers = HeaderWatch(stop, deadline=deadline, idle_timeout_s=config.read_timeout_s)
    try:
        with contextlib.ExitStack() as stack:
            with headers:
                response = _open_stream(stack, client, body, headers)
            if response.status_code != 200:
                raise error_for_status(response.status_code, read_head(response),
                                       response.headers.get("retry-after"))
            kind = response.headers.get("content-type", "")
            if not kind.startswith("text/event-stream"):
                raise MalformedStream(f"the model server did not stream its reply "
                                      f"(content-type {kind[:60] or 'none'})")
            check_identity(response)
            watch = stack.enter_context(StreamWatch(
                response, stop, deadline=deadline, reply_timeout_s=config.reply_timeout_s,
                idle_timeout_s=config.read_timeout_s))
            yield from _events(response, watch)
    except httpx.HTTPError as error:
        if watch is not None and watch.reason:  # the watcher hung up: a bound passed
            raise redacted(BackendTimeout(watch.reason), config) from None
        if headers.reason:  # likewise, before the body
            raise redacted(BackendTimeout(headers.reason), config) from None
        if stop.is_set():
            return  # the hang-up cut the read short: a stopped reply, not a failure
        raise translate(error, config) from error
    except BackendError as error:
        raise redacted(error, config) from None


def _open_stream(stack: contextlib.ExitStack, client: httpx.Client, body: dict,
                 headers: HeaderWatch) -> httpx.Response:
    """client.stream, once more on a fresh connection when a kept-alive one turns out to be
    closed before any answer ("disconnected without sending a response"): the server never
    saw that request, so sending it again cannot run it twice. Not after the header watch
    hung up: that server did see it."""
    extensions = {"trace": headers.trace}
    try:
        return stack.enter_context(client.stream("POST", "/chat/completions", json=body,
                                                 extensions=extensions))
    except httpx.RemoteProtocolError:
        if headers.reason or headers.stop.is_set():
            raise
        return stack.enter_context(client.stream("POST", "/chat/completions", json=body,
                                                 extensions=extensions))


def _events(response: httpx.Response, watch: StreamWatch) -> Iterator[dict]:
    """Each event's JSON until [DONE], the end of the stream, or `stop`. The bounds are
    checked after every read, however little it brought."""
    splitter = LineSplitter()
    for piece in response.iter_raw():
        if watch.stop.is_set():
            return
        watch.check()
        for raw in splitter.feed(piece):
            watch.line()
            event = _event_of(raw)
            if event is _DONE:
                return
            if event is not None:
                yield event
            if watch.stop.is_set():
                return
    if watch.stop.is_set():
        return
    watch.check()  # the watcher's hang-up ends a stream without a length as if complete
    event = _event_of(splitter.rest())  # a last line without its newline
    if event is not None and event is not _DONE:
        yield event


_DONE = {}  # the [DONE] line


def _event_of(raw: bytes) -> dict | None:
    """A line's event: its JSON, _DONE, or None for what is not an event (blank separators,
    ": keep-alive" comments, "event:" names)."""
    if not raw.startswith(b"data:"):
        return None
    data = raw[5:].decode("utf-8", "replace").strip()
    if data == "[DONE]":
        return _DONE
    event = parse_event(data)
    if "error" in event:  # an error reported in the stream
        error = event["error"]
        text = error.get("message") if isinstance(error, dict) else error
        raise BackendError(f"the model server failed mid-reply: {str(text)[:300]}")
    return event
