"""Blocking engine work for one HTTP client, on a worker thread, ended early when that client
goes away.

A thread blocked in next() on a reply cannot be cancelled: only the reply's stop event ends it
(the engine drops the row within a step; a model server's connection is hung up at once). So
while the thread runs, the client's connection is watched (polled, since nothing else reads it
before a streamed response starts), and a cancelled wait (Starlette cancels a streaming
response whose client left) sets the event too. The thread's return is then awaited, briefly,
so that the iterator it was reading is not closed while it still runs.

The /v1 routes use a thread pool of their own: replies stuck on a slow model server must not
take the threads that gradio's handlers (other users' pages) run on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import anyio
from starlette.requests import Request

DISCONNECT_POLL_S = 0.25  # how soon a client that went away is noticed
FINISH_WAIT_S = 5.0  # how long a stopped step may take to return before it is left behind


def reply_threads(concurrency: int) -> anyio.CapacityLimiter:
    """The /v1 routes' pool: a thread per reply in flight, and a few for requests refused
    at once."""
    return anyio.CapacityLimiter(concurrency + 8)


async def run_until_gone(request: Request | None, stop: threading.Event,
                         limiter: anyio.CapacityLimiter | None, fn: Callable, *args):
    """fn(*args) on a worker thread; `stop` is set as soon as the client is gone."""
    finished = threading.Event()
    outcome: dict = {}

    def call():
        try:
            outcome["value"] = fn(*args)
        except BaseException as error:  # noqa: BLE001 - raised again on the event loop
            outcome["error"] = error
        finally:
            finished.set()

    async def watch() -> None:
        while not finished.is_set():
            await anyio.sleep(DISCONNECT_POLL_S)
            if await request.is_disconnected():
                stop.set()
                return

    try:
        async with anyio.create_task_group() as group:
            if request is not None:
                group.start_soon(watch)
            await anyio.to_thread.run_sync(call, abandon_on_cancel=True, limiter=limiter)
            group.cancel_scope.cancel()
    except anyio.get_cancelled_exc_class():
        stop.set()
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(FINISH_WAIT_S):
                while not finished.is_set():
                    await anyio.sleep(0.01)
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")
