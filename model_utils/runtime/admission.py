"""Admitting waiting requests to the batch: which ones take free rows, and what happens when a
prefill fails. Pure Python; the runner does the forwards.

The half of scheduler.Scheduler that runs between decode steps (see its docstring for the
loop): free rows go to waiting requests, in the order they came, whose prompts are prefilled
in the groups prefill_groups.py picks; each first token is sampled, and each prompt's KV is
copied into its row. A group whose prefill fails is prefilled again request by request, so
that a request that cannot be prefilled ends by itself and the others of its group go on.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import TYPE_CHECKING

from .prefill_groups import prefill_groups

if TYPE_CHECKING:
    from .requests import Request
    from .runner import Prefilled
    from .scheduler import Failures, Runner

log = logging.getLogger(__name__)


class Admission:
    """Mixed into Scheduler, whose state and decode-side methods it uses (declared below)."""

    runner: Runner
    max_batch: int
    rows: list[Request]
    peak_rows: int
    _waiting: deque[Request]
    _lock: threading.Lock
    _admitted: int

    if TYPE_CHECKING:  # Scheduler's
        def _accept(self, request: Request, token: int) -> bool: ...
        def _finish(self, request: Request, reason: str,
                    error: BaseException | None = None) -> None: ...
        def _sampled(self, requests: list[Request], failures: Failures) -> None: ...

    def _admit(self) -> None:
        """Give free rows to waiting requests; their prompts are prefilled together."""
        capacity = self.runner.capacity or self.max_batch
        group: list[Request] = []
        with self._lock:
            while self._waiting and len(self.rows) + len(group) < capacity:
                group.append(self._waiting.popleft())
                self._admitted += 1
        starting = []
        for request in group:  # one look at each stop event: every request goes one way
            if request.stop.is_set():
                self._finish(request, "stop")
            else:
                starting.append(request)
        for chunk, padded in prefill_groups(starting, fits=self.runner.fits_padded,
                                            fit_together=self.runner.fit_padded_together):
            self._prefill_isolated(chunk, padded)

    def _prefill_isolated(self, requests: list[Request], padded: bool) -> None:
        """Prefill a group; if that fails, prefill each of its requests alone, so that a
        request that cannot be prefilled (whatever the cause) ends by itself and the others
        of its group go on."""
        try:
            self._prefill(requests, padded)
            return
        except Exception as group_error:  # noqa: BLE001 - sorted out below, one by one
            error = group_error
            if len(requests) == 1:
                self._fail_unplaced(requests, error)
                return
            log.warning("prefill of %d prompts together failed (%s): each alone now",
                        len(requests), error)
        for request in self._unplaced(requests):
            if request.new_tokens:  # its first token is out already: a retry would repeat it
                self._fail_unplaced([request], error)
                continue
            request.sampled = 0
            self.runner.release(request)  # set up afresh: a new generator, seen ids
            try:
                self._prefill([request], padded)
            except Exception as alone:  # noqa: BLE001 - this request fails, the others go on
                self._fail_unplaced([request], alone)

    def _unplaced(self, requests: list[Request]) -> list[Request]:
        """Those of `requests` not placed in a row, not ended and not sent back to wait."""
        with self._lock:
            requeued = set(self._waiting)
        return [r for r in requests if r not in self.rows and not r.finished
                and r not in requeued]

    def _fail_unplaced(self, requests: list[Request], error: Exception) -> None:
        log.error("prefill failed: %s", error, exc_info=error)
        for request in self._unplaced(requests):
            self._finish(request, "error", error)

    def _prefill(self, requests: list[Request], padded: bool = False) -> None:
        """Prefill prompts, sample each one's first token, and give each a row. A request whose
        own setup fails (its seed, say) ends here, before the forward."""
        ready = []
        for request in requests:
            try:
                self.runner.set_up(request)
            except Exception as error:  # noqa: BLE001 - this request fails, the others go on
                self._fail_unplaced([request], error)
            else:
                ready.append(request)
        if ready:
            self._start(ready, self.runner.prefill(ready, padded))

    def _start(self, requests: list[Request], prefilled: Prefilled) -> None:
        """Sample the first tokens of prefilled requests and give each a row. Memory may give
        the cache fewer rows than max_batch: the surplus waits again."""
        keep = self.runner.allocate(prefilled) - len(self.rows)
        if keep < len(requests):
            self._wait_again(requests[keep:])
            requests = requests[:keep]
        tokens, failures = self.runner.first_tokens(prefilled, requests)
        self._sampled(requests, failures)
        for i, (request, token) in enumerate(zip(requests, tokens)):
            if request.finished or not self._accept(request, token):  # (failed sampling)
                continue
            request.length = len(request.input_ids)
            row = len(self.rows)
            self.runner.place(row, prefilled, i, request.length, token)
            self.rows.append(request)
        self.peak_rows = max(self.peak_rows, len(self.rows))

    def _wait_again(self, requests: list[Request]) -> None:
        """Put admitted requests back at the head of the queue, in order."""
        if requests:
            with self._lock:
                self._waiting.extendleft(reversed(requests))
                self._admitted -= len(requests)
