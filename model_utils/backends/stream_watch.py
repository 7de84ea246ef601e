"""The bounds of one streamed reply, held whatever the server sends: a watcher thread hangs up
(shuts the socket down, which ends a blocked read at once and tells the server to free the
reply) when the user stops, when the whole reply passes its deadline, or when no complete line
has come for the idle timeout.

Why a thread and not httpx's read timeout alone: that timeout restarts with every byte, so a
server sending one byte a second never trips it, and a check between lines never runs while a
line that never ends is being read. The watcher counts lines, not bytes, and needs no read to
return.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx

from .errors import BackendTimeout


class StreamWatch:
    """Use as a context manager around the reading of `response`; call `line()` for each
    complete line read and `check()` between reads (which raises once a bound has passed,
    also where the socket could not be reached and the watcher cannot hang up)."""

    def __init__(self, response: httpx.Response, stop: threading.Event, *, deadline: float,
                 reply_timeout_s: float, idle_timeout_s: float):
        stream = response.extensions.get("network_stream")
        self.sock = stream.get_extra_info("socket") if stream is not None else None
        self.stop = stop
        self.deadline = deadline
        self.reply_timeout_s, self.idle_timeout_s = reply_timeout_s, idle_timeout_s
        self.last_line = time.monotonic()
        self.reason = ""  # why the watcher hung up, when a bound passed
        self._lock = threading.Lock()
        self._reading = True

    def __enter__(self) -> StreamWatch:
        if self.sock is not None:
            threading.Thread(target=self._watch, daemon=True, name="stream-watch").start()
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._reading = False  # the connection may go back to the pool: never touch it

    def line(self) -> None:
        self.last_line = time.monotonic()

    def overdue(self) -> str:
        """Which bound has passed, in words ("" while none has)."""
        now = time.monotonic()
        if now > self.deadline:
            return f"the reply took longer than {self.reply_timeout_s:g} s"
        if now - self.last_line > self.idle_timeout_s:
            return f"the model server sent nothing for {self.idle_timeout_s:g} s"
        return ""

    def check(self) -> None:
        reason = self.reason or self.overdue()
        if reason:
            raise BackendTimeout(reason)

    def _watch(self) -> None:
        while True:
            wait = min(self.deadline, self.last_line + self.idle_timeout_s) - time.monotonic()
            if self.stop.wait(max(wait, 0.0) + 0.01):
                break  # stopped, or the reply ended (RemoteEngine.chat sets it then too)
            with self._lock:
                if not self._reading:
                    return
            if reason := self.overdue():
                self.reason = reason
                break
        with self._lock:
            if self._reading:
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)


class HeaderWatch:
    """The same bounds before the body: from the request to the end of the response's headers
    at most the idle timeout (and never past the deadline or a Stop). httpx's read timeout
    restarts with each byte, so a server trickling a header a byte at a time held a place for
    as long as it liked. Pass `trace` as the request's "trace" extension: it is told the
    socket when the connection is made, which is why the streamed replies' connections are not
    kept alive between requests (a reused one announces no socket)."""

    POLL_S = 0.05

    def __init__(self, stop: threading.Event, *, deadline: float, idle_timeout_s: float):
        self.stop = stop
        self.until = min(deadline, time.monotonic() + idle_timeout_s)
        self.idle_timeout_s = idle_timeout_s
        self.sock: socket.socket | None = None
        self.reason = ""
        self._done = threading.Event()  # the headers are in, or the request ended
        self._lock = threading.Lock()

    def trace(self, name: str, info: dict) -> None:
        if name == "connection.connect_tcp.complete":
            stream = info.get("return_value")
            with self._lock:
                self.sock = stream.get_extra_info("socket") if stream is not None else None
        elif name == "http11.receive_response_headers.complete":
            self._done.set()

    def __enter__(self) -> HeaderWatch:
        threading.Thread(target=self._watch, daemon=True, name="header-watch").start()
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._done.set()  # from here the socket belongs to the body's StreamWatch

    def _watch(self) -> None:
        while not self._done.wait(self.POLL_S):
            if self.stop.is_set():
                reason = ""
            elif time.monotonic() > self.until:
                reason = f"the model server sent no complete answer headers for " \
                         f"{self.idle_timeout_s:g} s"
            else:
                continue
            with self._lock:
                if self._done.is_set() or self.sock is None:
                    return
                self.reason = reason
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)
            return
