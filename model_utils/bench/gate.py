"""Keeps a benchmark behind chat replies when it shares the engine with users (the UI panel).

The benchmark's own requests go through the batch scheduler like any reply, so a chat arriving
then joins their batch at the next step. What would starve chat is work that holds the decode
worker: plain generate and the teacher-forced run. Each such call waits until no reply is
decoding or waiting (engine.queue_status()), and is asked between its steps whether a reply
has arrived since; if so it stops at once (a StoppingCriteria for generate, Yielded for the
teacher-forced run), the reply is served, and the call runs again from the start later: its
timing would include the wait otherwise. Its many-request runs take at most three quarters of
the places (bench_share), so that a chat arriving meanwhile is admitted, not refused as busy.
The command-line benchmark has no users: NoGate.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def bench_share(places: int) -> int:
    """The most places a benchmark's requests take together when it shares the engine (or a
    model server) with users: a quarter of them, two at least, stay for other users' replies,
    which a run of more requests than places would otherwise turn away as busy."""
    return max(1, places - max(2, places // 4))


class Yielded(Exception):
    """A run gave the engine back to replies that arrived; it is to be run again later."""


class NoGate:
    """Nothing to yield to: every call runs once, straight away."""

    interruptions = 0

    def at_once(self) -> int | None:
        """The most of the benchmark's requests in flight together (None: no bound)."""
        return None

    def busy(self) -> bool:
        return False

    def wait_quiet(self) -> None:
        pass

    def run(self, fn: Callable[[Callable[[], bool]], object]):
        return fn(self.busy)


class Gate(NoGate):
    def __init__(self, engine, *, quiet_timeout_s: float = 120.0, max_retries: int = 50,
                 poll_s: float = 0.02, settle_s: float = 0.2):
        self.engine = engine
        self.quiet_timeout_s, self.max_retries, self.poll_s = quiet_timeout_s, max_retries, poll_s
        # Quiet this long before a call starts: a user's next message often follows the last
        # reply closely, and a call that starts in between only gives way again.
        self.settle_s = settle_s
        self.interruptions = 0  # calls that gave way to a reply and ran again
        self.in_call = threading.Event()  # set while a worker-holding call runs (status, tests)

    def at_once(self) -> int | None:
        queue = self.engine.queue_status()
        return bench_share(queue["max_batch"] + queue["max_queue"]) if queue else None

    def busy(self) -> bool:
        """A reply decoding or waiting (none of the benchmark's own: none is in flight when a
        worker-holding call asks)."""
        queue = self.engine.queue_status()
        return bool(queue and (queue["active"] or queue["waiting"]))

    def wait_quiet(self) -> None:
        deadline = time.monotonic() + self.quiet_timeout_s
        quiet_since = time.monotonic()
        while True:
            if self.busy():
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= self.settle_s:
                return
            if time.monotonic() > deadline:
                raise RuntimeError("replies kept the engine busy for "
                                   f"{self.quiet_timeout_s:.0f} s: run the benchmark later")
            time.sleep(self.poll_s)

    def run(self, fn):
        """fn(should_yield) once the engine is quiet, again if it yielded (Yielded or a
        result of None) to a reply that arrived meanwhile."""
        for _ in range(self.max_retries):
            self.wait_quiet()
            self.in_call.set()
            try:
                result = fn(self.busy)
            except Yielded:
                result = None
            finally:
                self.in_call.clear()
            if result is not None:
                return result
            self.interruptions += 1
        raise RuntimeError("replies kept arriving during the benchmark: run it later")


def stopping_when(should_yield: Callable[[], bool]):
    """A transformers StoppingCriteriaList that ends generate when `should_yield()`, noting it
    in `.yielded` so the caller can throw the run away."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class YieldToReplies(StoppingCriteria):
        yielded = False

        def __call__(self, input_ids, scores, **kwargs):
            stop = should_yield()
            self.yielded = self.yielded or stop
            return torch.full((input_ids.shape[0],), stop, dtype=torch.bool,
                              device=input_ids.device)

    criterion = YieldToReplies()
    return StoppingCriteriaList([criterion]), criterion
