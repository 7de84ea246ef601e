"""One thread runs every forward pass of the loaded model.

Why a dedicated thread: CUDA graphs recorded by torch.compile belong to the thread that recorded
them (torch keeps them in thread-local trees), and a web server answers each request on whichever
pool thread is free. Funnelling warm-up and decoding through one thread means a graph is recorded
once and replayed for every reply. Concurrent replies share it through scheduler.Scheduler,
whose decode loop is one long job here; other jobs (a warm-up, a cleanup) run between its runs.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
_DONE = object()  # the end of a stream's items


class DecodeWorker:
    def __init__(self, name: str = "decode-worker"):
        self._jobs: queue.Queue[Callable[[], Any]] = queue.Queue()
        self.idle_lock = threading.Lock()  # see post_while_idle
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job()
            except Exception:  # noqa: BLE001 - a posted job's bug must not kill the worker
                log.exception("a job on the decode worker failed")
            # Let go of the finished job before waiting for the next one: it closes over the
            # model it ran on, and an unloaded model must be freed now, not at the next job.
            del job

    def post(self, fn: Callable[[], Any]) -> None:
        """Queue fn to run on the worker thread and return at once; fn handles its own errors."""
        self._jobs.put(fn)

    def post_while_idle(self, step: Callable[[], bool], busy: Callable[[], bool],
                        cancelled: threading.Event) -> None:
        """Work that may wait and must not hold up replies (graphs captured after a load):
        step() runs on the worker, one call per job, until it returns False or `cancelled` is
        set. A job that finds busy() true is posted again a moment later: a reply's batch loop,
        queued behind it, then runs first (for as long as replies decode), so a request that
        comes waits for one step at most. Each step holds `idle_lock`: another thread's GPU
        call that must not meet a graph capture (CUDA refuses other threads' unsafe calls
        while one is under way) takes the lock first (engine.Engine)."""

        def job():
            if cancelled.is_set():
                return
            if busy():
                later = threading.Timer(0.05, self.post, (job,))
                later.daemon = True
                later.start()
                return
            with self.idle_lock:
                more = not cancelled.is_set() and step()
            if more and not cancelled.is_set():
                self.post(job)

        self.post(job)

    def call(self, fn: Callable[[], T]) -> T:
        """Run fn on the worker thread and return its result (re-raising its exception)."""
        if threading.current_thread() is self._thread:
            return fn()
        done = threading.Event()
        box: dict[str, Any] = {}  # "value" or "error"

        def job():
            try:
                box["value"] = fn()
            except BaseException as error:  # noqa: BLE001 - handed to the caller
                box["error"] = error
            finally:
                done.set()

        self._jobs.put(job)
        done.wait()
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def stream(self, produce: Callable[[], Iterator[T]]) -> Iterator[T]:
        """Iterate produce() on the worker thread, yielding its items here as they come.

        The producer must end by itself when asked (the engine passes it a stop event it sets
        when this iterator is closed); items are buffered, so the worker never blocks on a slow
        or vanished consumer.
        """
        items: queue.Queue[Any] = queue.Queue()  # produced items, then _DONE or an error

        def job():
            try:
                for item in produce():
                    items.put(item)
                items.put(_DONE)
            except BaseException as error:  # noqa: BLE001 - handed to the consumer
                items.put(error)

        self._jobs.put(job)
        while True:
            item = items.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
