"""Continuous batching, the deciding half: the queue, admission, rows, when a reply ends.

Why our own scheduler: transformers' continuous batching (generate_batch, paged attention) was
measured on an H200 at 332 tok/s aggregate for 32 requests, against a target of 3000; it also
runs its own thread and cache, where our CUDA graphs must stay on the engine's decode worker. So
the loop below is ours; the model, its StaticLayer cache and its masks are transformers' own.

Pure Python: every forward pass, tensor and the KV cache belong to the runner (runner.py, the
`Runner` protocol below), which this loop drives on the engine's DecodeWorker while there is
work:

    admit   waiting requests take free rows: their prompts are prefilled together (see
            prefill_groups.py), each first token sampled, each prompt's KV copied into its row
    drop    requests whose stop event is set (Stop, a closed tab, a vanished client) leave
    step    one step for all active rows, each row sampled with its own settings on the device:
            the sampled tokens are the next step's inputs there, and the next step is launched
            before the host reads them (it pushes each token to its request's queue while the
            GPU runs the step after), so the GPU does not wait for Python between steps;
            finished rows leave

so a request joins or leaves between two steps and never waits for the batch to finish. The
number of requests admitted or waiting is bounded (max_batch + max_queue): one more gets
QueueFull at once, never a hang. One request's failure (its prefill, its sampling) ends that
request only.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from model_utils.errors import QueueFull

from .admission import Admission
from .requests import DONE, Request

if TYPE_CHECKING:
    from .generation import GenerationSettings, ReplyStats
    from .runner import Prefilled
    from .sampling import TopK

log = logging.getLogger(__name__)

MAX_BATCH_LIMIT = 64
Failures = list[tuple[int, Exception]]


class Runner(Protocol):
    """What the scheduler asks of the runner (runner.BatchRunner, where each is described;
    the unit tests drive the scheduler with a plain-Python one). `Prefilled` is the runner's
    own record of a prefill, handed back to it as is."""

    @property
    def capacity(self) -> int | None: ...  # rows of the cache, None before the first prompt
    def session(self) -> AbstractContextManager: ...  # the context the whole loop runs in
    def fits_padded(self, tokens: int) -> bool: ...  # the padded prefill takes this prompt
    def fit_padded_together(self, lengths: list[int]) -> bool: ...  # ... these in one replay
    def set_up(self, request: Request) -> None: ...  # its sampling state; may raise
    def release(self, request: Request) -> None: ...  # forget that state
    def prefill(self, requests: list[Request], padded: bool) -> Prefilled: ...
    def allocate(self, prefilled: Prefilled) -> int: ...  # makes the cache; returns its rows
    def first_tokens(self, prefilled: Prefilled,
                     requests: list[Request]) -> tuple[list[int], Failures]: ...
    def place(self, row: int, prefilled: Prefilled, source: int, length: int,
              token: int) -> None: ...  # prompt `source`'s KV into `row`, `token` next
    def launch(self, rows: list[Request],
               longest: int) -> tuple[Callable[[], list[int]], Failures]: ...  # one step
    def move_row(self, src: int, dst: int, length: int) -> None: ...


def check_limits(max_batch: int, max_queue: int) -> None:
    if not isinstance(max_batch, int) or not 1 <= max_batch <= MAX_BATCH_LIMIT:
        raise ValueError(f"max_batch must be between 1 and {MAX_BATCH_LIMIT}, got {max_batch}")
    if not isinstance(max_queue, int) or max_queue < 0:
        raise ValueError(f"max_queue must be >= 0, got {max_queue}")


class Scheduler(Admission):
    """Decodes the requests of one loaded model together. Thread-safe `submit`; the loop runs
    on `post`'s thread (the engine's DecodeWorker)."""

    def __init__(self, runner: Runner, *, post: Callable[[Callable[[], None]], None],
                 context_tokens: int, max_batch: int = 8, max_queue: int = 64,
                 path_name: str = "eager"):
        check_limits(max_batch, max_queue)
        self.runner = runner
        self.post = post
        self.context_tokens = context_tokens
        self.max_batch, self.max_queue = max_batch, max_queue
        self.path_name = path_name
        self.rows: list[Request] = []  # active requests; rows[i] decodes in cache row i
        self._waiting: deque[Request] = deque()
        self._lock = threading.Lock()
        self._admitted = 0  # requests taken off the queue and not finished (under _lock)
        self._running = False  # the loop is posted or running (under _lock)
        self.peak_rows = 0
        # (request, the error that ended it or None), streams ended by _flush_ended
        self._ended: list[tuple[Request, BaseException | None]] = []

    # -- any thread ---------------------------------------------------------------------------
    def submit(self, input_ids: list[int], settings: GenerationSettings, *, eos_ids: set[int],
               stop: threading.Event, stats: ReplyStats,
               logprobs: list[TopK] | None = None) -> Iterator[int]:
        """Queue one reply; returns the iterator of its token ids. Raises QueueFull when
        max_batch replies are decoding and max_queue more are waiting. `logprobs`: a list that
        receives each token's top-k log-probabilities (see Request.logprobs); it may hold one
        entry more than the reply has tokens (a step in flight when the reply ended)."""
        if not input_ids or len(input_ids) + settings.max_new_tokens > self.context_tokens:
            # Checked here: a reply that outgrew its row would fail the whole batch's step.
            raise ValueError(f"{len(input_ids)} prompt tokens + max_new_tokens "
                             f"{settings.max_new_tokens} do not fit the context window "
                             f"({self.context_tokens}), or the prompt is empty")
        request = Request(list(input_ids), settings, set(eos_ids), stop, stats,
                          logprobs=logprobs)
        stats.prompt_tokens = len(input_ids)
        stats.decode_path = self.path_name
        with self._lock:
            in_flight = self._admitted + len(self._waiting)
            if in_flight >= self.max_batch + self.max_queue:
                raise QueueFull(f"the server is busy ({in_flight} replies in progress or "
                                "waiting): try again shortly")
            self._waiting.append(request)
            start = not self._running
            self._running = True
        if start:
            self.post(self._loop)
        return request.tokens()

    def load(self) -> dict[str, int]:
        with self._lock:
            return {"active": self._admitted, "waiting": len(self._waiting),
                    "max_batch": self.max_batch, "max_queue": self.max_queue}

    # -- the decode worker --------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            with self.runner.session():
                while self._iterate():
                    pass
        except BaseException as error:  # a bug: fail everyone rather than hang them
            log.exception("batch loop failed")
            self._fail_all(error)
            self._flush_ended()
            with self._lock:
                waiting, self._waiting = list(self._waiting), deque()
                self._running = False
            for request in waiting:
                self.runner.release(request)
                request.out.put(error)

    def _iterate(self) -> bool:
        try:
            self._admit()
            self._drop(i for i, r in enumerate(self.rows) if r.stop.is_set())
            if self.rows:
                try:
                    self._decode()
                except Exception as error:  # noqa: BLE001 - e.g. out of memory: they fail
                    log.exception("batched decode step failed")
                    self._fail_all(error)
                return True
        finally:
            self._flush_ended()
        with self._lock:
            if self._waiting:
                return True
            self._running = False
            return False

    def _decode(self) -> None:
        """Decode the current rows until one finishes, is stopped, or a request waits to join.

        Each step is launched before the previous one's tokens are read, so the GPU runs step
        n + 1 while the host hands out step n's tokens. When the rows must change, the step in
        flight is read too (its tokens count for the rows still going on; a row that finished
        one step earlier wastes that one step) and the finished rows leave.
        """
        launched = self._launch()
        while True:
            following = self._launch() if self._may_go_on() else None
            self._collect(launched)
            if following is None:
                break
            if self._must_regroup():
                self._collect(following)
                break
            launched = following
        self._drop([i for i, r in enumerate(self.rows) if r.finished], finished=True)

    def _may_go_on(self) -> bool:
        """Launch another step before reading the one in flight? Not when that one ends a row
        (its last token by max_new_tokens), a row was stopped, or a request waits."""
        return not self._waiting and not any(
            r.finished or r.sampled >= r.settings.max_new_tokens or r.stop.is_set()
            for r in self.rows)

    def _must_regroup(self) -> bool:
        return bool(self._waiting) or any(r.finished or r.stop.is_set() for r in self.rows)

    def _launch(self) -> _Launched:
        """Queue one step for every active row and the sampling of its tokens; nothing waits
        for the device."""
        rows = list(self.rows)
        read, failures = self.runner.launch(rows, max(r.length for r in rows))
        for request in rows:
            request.length += 1
            request.stats.batched_with = max(request.stats.batched_with, len(rows))
        self._sampled(rows, failures)
        return _Launched(rows, read)

    def _collect(self, launched: _Launched) -> None:
        """Hand out the tokens of a launched step (waiting for it if it still runs)."""
        for request, token in zip(launched.rows, launched.read()):
            if not request.finished:  # a row that ended one step earlier: its token is void
                self._accept(request, token)

    def _sampled(self, requests: list[Request], failures: Failures) -> None:
        """Count the tokens the runner sampled for `requests` (a request that had ended gets
        none); a row whose sampling raised ends alone, with its error."""
        for request in requests:
            if not request.finished:
                request.sampled += 1
        for i, error in failures:
            log.error("sampling failed for one reply: %s", error, exc_info=error)
            self._finish(requests[i], "error", error)

    def _accept(self, request: Request, token: int) -> bool:
        """Hand one sampled token on; False when the request is done (and ended here)."""
        reason = request.accept(token)
        if reason:
            self._finish(request, reason)
        return not reason

    def _drop(self, indices: Iterable[int], *, finished: bool = False) -> None:
        """Free the rows at `indices`; the last active row moves into each hole."""
        for i in sorted(indices, reverse=True):
            request = self.rows[i]
            if not finished:
                self._finish(request, "stop")
            last = len(self.rows) - 1
            if i != last:
                self.runner.move_row(last, i, self.rows[last].length)
                self.rows[i] = self.rows[last]
            self.rows.pop()

    def _finish(self, request: Request, reason: str, error: BaseException | None = None) -> None:
        request.mark_finished(reason)
        self.runner.release(request)
        with self._lock:
            self._admitted -= 1
        self._ended.append((request, error))

    def _flush_ended(self) -> None:
        """End the streams of requests finished in this iteration. Deferred to its end, after
        this iteration's last tensor work (rows moving), so that a caller that exits as soon as
        its reply ends (the CLI) never tears the process down under a running torch op."""
        ended, self._ended = self._ended, []
        for request, error in ended:
            request.out.put(error if error is not None else DONE)

    def _fail_all(self, error: BaseException) -> None:
        for request in self.rows:
            if not request.finished:
                self._finish(request, "error", error)
        self.rows = []


@dataclass(eq=False)
class _Launched:
    rows: list[Request]  # the rows of the step, in order
    read: Callable[[], list[int]]  # their tokens, once the step has run
