"""A wall-clock bound on the whole of one short answer from the model server (the health
check's GET /models, GET /get_model_info), headers and body together.

httpx's timeouts hold per read: a server that sends one byte a second never trips them, so a
/models answer trickled that way held the health-check thread (and the page's sliders waiting
for the model's defaults) for as long as the server liked. A watcher thread shuts the socket
down at the deadline, which ends a blocked read at once, wherever it is in the answer. Pass
`trace` as the request's "trace" extension: it is told the socket when the connection is made,
which is why these requests go on connections that are not kept alive (a reused one announces
no socket).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class AnswerDeadline:
    """Use as a context manager around one request and the reading of its answer; `expired`
    says afterwards whether the watcher hung up."""

    POLL_S = 0.05  # after the deadline, while the connection is still being made

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.until = time.monotonic() + timeout_s
        self.expired = False
        self._sock: socket.socket | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()

    def trace(self, name: str, info: dict) -> None:
        if name == "connection.connect_tcp.complete":
            stream = info.get("return_value")
            with self._lock:
                self._sock = stream.get_extra_info("socket") if stream is not None else None

    def __enter__(self) -> AnswerDeadline:
        threading.Thread(target=self._watch, daemon=True, name="answer-deadline").start()
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._done.set()  # read or failed: the socket is no longer this watcher's

    def _watch(self) -> None:
        if self._done.wait(max(self.until - time.monotonic(), 0.0)):
            return
        # Still connecting (bounded by the connect timeout): hang up once the socket is known.
        while True:
            with self._lock:
                if self._done.is_set():
                    return
                if self._sock is not None:
                    self.expired = True
                    with contextlib.suppress(OSError):
                        self._sock.shutdown(socket.SHUT_RDWR)
                    return
            self._done.wait(self.POLL_S)
