"""The requests waiting for the batch, and the count of those admitted: the scheduler's one
piece of state that other threads touch (a reply arrives from a web server's thread), behind
one lock. Pure Python.

Bounded: at most `limit` requests admitted or waiting; one more is refused with QueueFull at
once, never made to hang. It also knows whether the scheduler's loop is posted or running, so
that exactly one loop runs while there is work.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING

from model_utils.errors import QueueFull

if TYPE_CHECKING:
    from .requests import Request


class RequestQueue:
    def __init__(self, limit: int):
        self.limit = limit
        self._waiting: deque[Request] = deque()
        self._lock = threading.Lock()
        self._admitted = 0  # taken off the queue and not finished
        self._running = False  # the loop is posted or running

    # -- any thread ---------------------------------------------------------------------------
    def put(self, request: Request) -> bool:
        """Queue a request; True when the loop must be started for it. Raises QueueFull."""
        with self._lock:
            in_flight = self._admitted + len(self._waiting)
            if in_flight >= self.limit:
                raise QueueFull(f"the server is busy ({in_flight} replies in progress or "
                                "waiting): try again shortly")
            self._waiting.append(request)
            start = not self._running
            self._running = True
        return start

    def counts(self) -> tuple[int, int]:
        """(admitted, waiting) now."""
        with self._lock:
            return self._admitted, len(self._waiting)

    def __bool__(self) -> bool:  # anyone waiting (a glance; the loop decides under the lock)
        return bool(self._waiting)

    # -- the scheduler's loop -----------------------------------------------------------------
    def head(self) -> Request | None:
        """The request that has waited longest, left in the queue."""
        with self._lock:
            return self._waiting[0] if self._waiting else None

    def take_stopped(self) -> list[Request]:
        """The waiting requests whose stop is set, taken out as if admitted (each ends with
        finished(), as an admitted one does)."""
        with self._lock:
            stopped, kept = [], deque()
            for request in self._waiting:
                (stopped if request.stop.is_set() else kept).append(request)
            if stopped:
                self._waiting = kept
                self._admitted += len(stopped)
        return stopped

    def take(self) -> Request:
        """The head, now admitted."""
        with self._lock:
            self._admitted += 1
            return self._waiting.popleft()

    def put_back(self, request: Request) -> None:
        """An admitted request waits again, first in line (it was preempted)."""
        with self._lock:
            self._waiting.appendleft(request)
            self._admitted -= 1

    def finished(self) -> None:
        """An admitted request ended."""
        with self._lock:
            self._admitted -= 1

    def stop_if_empty(self) -> bool:
        """End the loop unless a request waits: True when it must go on."""
        with self._lock:
            if self._waiting:
                return True
            self._running = False
            return False

    def drain(self) -> list[Request]:
        """Every waiting request, the queue emptied and the loop marked stopped (it failed)."""
        with self._lock:
            waiting, self._waiting = list(self._waiting), deque()
            self._running = False
        return waiting
