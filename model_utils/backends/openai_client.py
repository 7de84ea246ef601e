"""The OpenAI chat API as a client: the model list, the request body, and the streamed reply
parsed from server-sent events. No policy here (retries, notices, stats): remote.py has that.

Every wait is bounded by httpx's timeouts: connect (reaching the server), read (between two
pieces of the reply, the wait for the first token included) and pool (a free connection); the
whole reply is bounded by a deadline that the reader checks between events.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from .errors import (
    BackendBusy,
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    MalformedStream,
    error_for_status,
)
from .urls import redact

ERROR_BODY_BYTES = 8192  # what is read of an error reply: enough for its message


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


def make_client(config: ServerConfig, connections: int) -> httpx.Client:
    headers = {"Authorization": f"Bearer {config.key}"} if config.key else {}
    timeout = httpx.Timeout(connect=config.connect_timeout_s, read=config.read_timeout_s,
                            write=config.read_timeout_s, pool=config.connect_timeout_s)
    # Idle connections are let go after 2 s, before the server's own keep-alive timeout
    # (uvicorn's, under vLLM and this app: 5 s) can close one just as a request goes out.
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections,
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


def list_models(client: httpx.Client, config: ServerConfig) -> list[dict]:
    """GET /models -> [{"id", "max_model_len"?...}]."""
    try:
        response = client.get("/models")
    except httpx.HTTPError as error:
        raise translate(error, config) from error
    if response.status_code != 200:
        raise error_for_status(response.status_code, response.content[:ERROR_BODY_BYTES],
                               response.headers.get("retry-after"))
    try:
        data = response.json()["data"]
        return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
    except (ValueError, KeyError, TypeError):
        raise MalformedStream("the model server's /models answer is not an OpenAI model "
                              "list") from None


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
    set, the deadline passes (BackendTimeout) or the consumer closes this generator."""
    try:
        with contextlib.ExitStack() as stack:
            response = _open_stream(stack, client, body)
            if response.status_code != 200:
                raise error_for_status(response.status_code, _head(response),
                                       response.headers.get("retry-after"))
            kind = response.headers.get("content-type", "")
            if not kind.startswith("text/event-stream"):
                raise MalformedStream(f"the model server did not stream its reply "
                                      f"(content-type {kind[:60] or 'none'})")
            with _HangUpOnStop(response, stop):
                yield from _events(response, config, stop, deadline)
    except httpx.HTTPError as error:
        if stop.is_set():
            return  # the hang-up below cut the read short: a stopped reply, not a failure
        raise translate(error, config) from error


def _open_stream(stack: contextlib.ExitStack, client: httpx.Client,
                 body: dict) -> httpx.Response:
    """client.stream, once more on a fresh connection when a kept-alive one turns out to be
    closed before any answer ("disconnected without sending a response"): the server never
    saw that request, so sending it again cannot run it twice."""
    try:
        return stack.enter_context(client.stream("POST", "/chat/completions", json=body))
    except httpx.RemoteProtocolError:
        return stack.enter_context(client.stream("POST", "/chat/completions", json=body))


class _HangUpOnStop:
    """Stop takes effect while the server is silent too (a reply queued there, a long
    prefill): a watcher shuts the socket down when `stop` is set, which ends the blocked read
    at once and tells the server to free the reply. Never after the reply ended, when the
    connection may already serve another request from the pool."""

    def __init__(self, response: httpx.Response, stop: threading.Event):
        stream = response.extensions.get("network_stream")
        self.sock = stream.get_extra_info("socket") if stream is not None else None
        self.stop = stop
        self.lock = threading.Lock()
        self.reading = True

    def __enter__(self):
        if self.sock is not None:
            threading.Thread(target=self._watch, daemon=True, name="hang-up-on-stop").start()
        return self

    def _watch(self) -> None:
        self.stop.wait()  # RemoteEngine.chat sets it when every reply ends, stopped or not
        with self.lock:
            if self.reading:
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)

    def __exit__(self, *exc) -> None:
        with self.lock:
            self.reading = False


def _events(response: httpx.Response, config: ServerConfig, stop: threading.Event,
            deadline: float) -> Iterator[dict]:
    """Each event's JSON until [DONE], the end of the stream, or `stop`."""
    for line in response.iter_lines():
        if stop.is_set():
            return
        if time.monotonic() > deadline:
            raise BackendTimeout(f"the reply took longer than "
                                 f"{config.reply_timeout_s:g} s")
        if not line.startswith("data:"):
            continue  # blank separators, ": keep-alive" comments, "event:" names
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            event = json.loads(data)
        except ValueError:
            raise MalformedStream("the model server sent an event that is not "
                                  "JSON") from None
        if not isinstance(event, dict):
            raise MalformedStream("the model server sent an event that is not a "
                                  "JSON object")
        if "error" in event:  # an error reported in the stream
            error = event["error"]
            text = error.get("message") if isinstance(error, dict) else error
            raise BackendError(f"the model server failed mid-reply: {str(text)[:300]}")
        yield event


def _head(response: httpx.Response) -> bytes:
    """The start of an error body, without waiting for the rest of a huge one."""
    out = b""
    for piece in response.iter_bytes():
        out += piece
        if len(out) >= ERROR_BODY_BYTES:
            break
    return out[:ERROR_BODY_BYTES]
