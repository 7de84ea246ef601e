"""Continuous batching, the deciding half: the queue, admission, rows, the KV blocks each reply
holds, when a reply ends.

Why our own: transformers' continuous batching is far slower at 32 requests (BENCHMARKS.md) and
keeps its own thread and cache, where our CUDA graphs must stay on the decode worker. Its shape is
vLLM's: a scheduler owns the KV-cache accounting, a runner (runner.py, the `Runner` protocol in
runner_protocol.py) every forward pass and tensor. Pure Python; this loop drives the runner on
the engine's DecodeWorker while there is work:

    admit   waiting requests take free rows, in the order they came, as long as the KV cache
            has blocks for their prompts (cache_manager.py: a prompt's start that is cached
            already, a shared system prompt or the earlier turns of the conversation, is reused,
            not computed); their prompts are prefilled together where they can be (see
            prefill_groups.py), each first token sampled, each request given a row
    drop    requests whose stop event is set (Stop, a closed tab, a vanished client) leave
    step    one step for all active rows, each row sampled with its own settings on the device:
            the sampled tokens are the next step's inputs there, and the next step is launched
            before the host reads them (not with a constrained row, whose mask needs its
            token); a row whose next token starts a block gets one first; finished rows leave

so a request joins or leaves between two steps and never waits for the batch to finish. When
the cache is full, a waiting request waits for blocks (the queue status says so) and a growing
reply that finds none takes them from the reply admitted last, which is sent back to wait at
the head of the queue and resumes later from its tokens so far (most of them found in the
cache again): never an out-of-memory error. At most max_batch + max_queue requests are
admitted or waiting: one more gets QueueFull at once. One request's failure ends that request
only (a group whose prefill fails is prefilled again one by one).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .cache_manager import CacheManager
from .prefill_groups import prefill_groups
from .request_queue import RequestQueue
from .requests import DONE, Request
from .runner_protocol import Failures, Runner, check_limits

if TYPE_CHECKING:
    from model_utils.runtime.generation_settings import GenerationSettings
    from model_utils.runtime.reply_stats import ReplyStats

    from .grammar import Constraint
    from .runner import Prefilled
    from .sampling import TopK

log = logging.getLogger(__name__)

class Scheduler:
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
        self.cache: CacheManager | None = None  # made by the loop's first admission
        self.queue = RequestQueue(max_batch + max_queue)
        self._order = itertools.count()  # admission order: the last admitted is preempted first
        self.peak_rows = 0
        self.preemptions = 0
        self.waiting_for_memory = False  # the queue's head waits for KV blocks
        # (request, the error that ended it or None), streams ended by _flush_ended
        self._ended: list[tuple[Request, BaseException | None]] = []

    # -- any thread ---------------------------------------------------------------------------
    def submit(self, input_ids: list[int], settings: GenerationSettings, *, eos_ids: set[int],
               stop: threading.Event, stats: ReplyStats,
               logprobs: list[TopK] | None = None, logprob_k: int = 5,
               chosen: list | None = None, constraint: Constraint | None = None) -> Iterator[int]:
        """Queue one reply; returns the iterator of its token ids. Raises QueueFull when
        max_batch replies are decoding and max_queue more are waiting. `logprobs`: a list that
        receives each token's top-k log-probabilities (see Request.logprobs); it may hold one
        entry more than the reply has tokens (a step in flight when the reply ended); `logprob_k`
        alternatives each, and in `chosen` the drawn token's log-probability. `constraint`:
        the format the reply must follow (grammar.Constraint)."""
        if not input_ids or len(input_ids) + settings.max_new_tokens > self.context_tokens:
            # Checked here: the KV cache is sized for one whole context at least.
            raise ValueError(f"{len(input_ids)} prompt tokens + max_new_tokens "
                             f"{settings.max_new_tokens} do not fit the context window "
                             f"({self.context_tokens}), or the prompt is empty")
        request = Request(list(input_ids), settings, set(eos_ids), stop, stats,
                          logprobs=logprobs, logprob_k=logprob_k, chosen=chosen,
                          constraint=constraint)
        stats.prompt_tokens = len(input_ids)
        stats.decode_path = self.path_name
        if self.queue.put(request):
            self.post(self._loop)
        return request.tokens()

    def load(self) -> dict:
        admitted, waiting = self.queue.counts()
        load = {"active": admitted, "waiting": waiting, "max_batch": self.max_batch,
                "max_queue": self.max_queue}
        if self.waiting_for_memory:
            load["waiting_for"] = "KV cache blocks"
        return load

    def kv_blocks(self) -> dict | None:
        """The KV cache's blocks (used, cached, free) and what reuse saved, once allocated."""
        if self.cache is None:
            return None
        return {**self.cache.counts().as_dict(), "reused_tokens": self.cache.pool.hits_tokens,
                "preemptions": self.preemptions}

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
            for request in self.queue.drain():
                self._let_go(request, keep=False)
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
        return self.queue.stop_if_empty()

    # -- admission ----------------------------------------------------------------------------
    def _admit(self) -> None:
        """Give free rows to waiting requests, in order, while the KV cache has room for their
        prompts; their prompts are prefilled together."""
        if self.cache is None:
            self.cache = CacheManager(self.runner.blocks())
        self.waiting_for_memory = False
        # Gone before they started, wherever they wait: places freed, no blocks or prefill spent.
        for request in self.queue.take_stopped():
            self._finish(request, "stop")
        group: list[Request] = []
        try:
            while len(self.rows) + len(group) < self.runner.capacity:
                request = self.queue.head()
                if request is None:
                    break
                # A padded prompt is computed whole: as fast as reading a prefix back, one replay.
                reuse = not self.runner.fits_padded(len(request.prompt_ids))
                if not self.cache.admit(request, reuse=reuse,
                                        headroom=len(self.rows) + len(group),
                                        min_reuse=self.runner.min_reuse_tokens,
                                        reusable=self.runner.reusable_blocks):
                    self.waiting_for_memory = True
                    break
                self.queue.take().admitted = next(self._order)
                if not request.preempted:
                    request.stats.cached_tokens = request.cached_tokens
                group.append(request)
            for chunk, padded in prefill_groups(group, fits=self._fits_padded,
                                                fit_together=self.runner.fit_padded_together):
                self._prefill_isolated(chunk, padded)
        except BaseException as error:  # out of the queue, in no row: no stream may hang
            for request in self._unplaced(group):  # the loop logs the failure, once
                self._finish(request, "error", error)
            raise

    def _fits_padded(self, request: Request) -> bool:
        return request.cached_tokens == 0 and self.runner.fits_padded(len(request.prompt_ids))

    def _prefill_isolated(self, requests: list[Request], padded: bool) -> None:
        """Prefill a group; if that fails, prefill each of its requests alone, so that a
        request that cannot be prefilled (whatever the cause) ends by itself and the others
        of its group go on."""
        before = {r: (r.new_tokens, r.sampled) for r in requests}  # a resumed one's counts
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
            handed_out, request.sampled = before[request]
            if request.new_tokens > handed_out:  # a token is out: a retry would repeat it
                self._fail_unplaced([request], error)
                continue
            if not request.preempted:  # set up afresh (a resumed reply keeps the state it had)
                self.runner.release(request)
            try:
                self._prefill([request], padded)
            except Exception as alone:  # noqa: BLE001 - this request fails, the others go on
                self._fail_unplaced([request], alone)

    def _unplaced(self, requests: list[Request]) -> list[Request]:
        """Those of `requests` not placed in a row and not ended."""
        return [r for r in requests if r not in self.rows and not r.finished]

    def _fail_unplaced(self, requests: list[Request], error: BaseException) -> None:
        log.error("prefill failed: %s", error, exc_info=error)
        for request in self._unplaced(requests):
            self._finish(request, "error", error)

    def _prefill(self, requests: list[Request], padded: bool = False) -> None:
        """Prefill prompts, sample each one's next token, and give each a row. A request whose
        own setup fails (its seed, say) ends here, before the forward. A resumed request keeps
        the sampling state it had."""
        ready = []
        for request in requests:
            try:
                if not self.runner.is_set_up(request):
                    self.runner.set_up(request)
            except Exception as error:  # noqa: BLE001 - this request fails, the others go on
                self._fail_unplaced([request], error)
            else:
                ready.append(request)
        if ready:
            self._start(ready, self.runner.prefill(ready, padded))

    def _start(self, requests: list[Request], prefilled: Prefilled) -> None:
        """Sample the next token of prefilled requests and give each a row."""
        tokens, failures = self.runner.first_tokens(prefilled, requests)
        for request in requests:
            request.length = len(request.prompt_ids)
            self.cache.computed(request)
        self._sampled(requests, failures)
        for request, token in zip(requests, tokens):
            if request.finished or not self._accept(request, token):  # (failed sampling)
                continue
            row = len(self.rows)
            self.runner.place(row, request, token)
            self.rows.append(request)
        self.peak_rows = max(self.peak_rows, len(self.rows))

    # -- decoding -----------------------------------------------------------------------------
    def _decode(self) -> None:
        """Decode the current rows until one finishes, is stopped, or a request waits to join.

        Step n + 1 is launched before step n's tokens are read. When the rows must change,
        the step in flight is read too (a row that finished one step earlier wastes it) and
        the finished rows leave. A step that needs more blocks than are free is not launched
        ahead: with no step in flight, rows are preempted until it has them."""
        self._grow_or_preempt()
        launched = self._launch()
        while True:
            following = self._launch() if self._may_go_on() and self._grow() else None
            self._collect(launched)
            if following is None:
                break
            if self._must_regroup():
                self._collect(following)
                break
            launched = following
        self._drop([i for i, r in enumerate(self.rows) if r.finished], finished=True)

    def _grow(self) -> bool:
        """The blocks the next step writes into, for every row; False when there are too few."""
        entries = self.cache.grow(self.rows)
        if entries is None:
            return False
        self.runner.add_blocks(entries)
        return True

    def _grow_or_preempt(self) -> None:
        while not self._grow():
            if len(self.rows) == 1:  # cannot happen: the cache holds one whole context
                raise RuntimeError("the KV cache has no block left for the only reply")
            victim = max(range(len(self.rows)), key=lambda i: self.rows[i].admitted)
            self._preempt(victim)

    def _preempt(self, index: int) -> None:
        """Send row `index` back to the head of the queue, its blocks named and let go: it
        resumes from its tokens so far, most of them found in the cache again."""
        request = self.rows[index]
        log.info("KV cache full: reply admitted #%d waits again after %d tokens (%d blocks)",
                 request.admitted, request.new_tokens, len(request.blocks))
        self.cache.release(request, keep=True)
        request.prompt_ids = request.input_ids + request.output
        request.length = 0
        request.preempted += 1
        self.preemptions += 1
        self._remove_row(index)
        self.queue.put_back(request)

    def _may_go_on(self) -> bool:
        """Launch another step before reading the one in flight? Not when that one ends a row,
        a row was stopped, a request waits, or a row is constrained (its mask needs it)."""
        return not self.queue and not any(
            r.finished or r.sampled >= r.settings.max_new_tokens or r.stop.is_set()
            or r.constraint is not None for r in self.rows)

    def _must_regroup(self) -> bool:
        return bool(self.queue) or any(r.finished or r.stop.is_set() for r in self.rows)

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

    # -- leaving ------------------------------------------------------------------------------
    def _drop(self, indices: Iterable[int], *, finished: bool = False) -> None:
        """Free the rows at `indices`; the last active row moves into each hole."""
        for i in sorted(indices, reverse=True):
            if not finished:
                self._finish(self.rows[i], "stop")
            self._remove_row(i)

    def _remove_row(self, i: int) -> None:
        last = len(self.rows) - 1
        if i != last:
            self.runner.move_row(last, i)
            self.rows[i] = self.rows[last]
        else:
            self.runner.clear_row(last)
        self.rows.pop()

    def _finish(self, request: Request, reason: str, error: BaseException | None = None) -> None:
        request.mark_finished(reason)
        self._let_go(request, keep=error is None)
        self.queue.finished()
        self._ended.append((request, error))

    def _let_go(self, request: Request, *, keep: bool) -> None:
        """A request's device state and blocks; with `keep`, its computed tokens stay findable
        in the cache (the conversation's next turn starts with them)."""
        self.runner.release(request)
        if self.cache is not None and request.blocks:
            self.cache.release(request, keep=keep)

    def _flush_ended(self) -> None:
        """End the streams of requests finished in this iteration. Deferred to its end, after
        this iteration's last tensor work (rows moving), so that a caller that exits as soon as
        its reply ends (the CLI) never tears the process down under a running torch op."""
        ended, self._ended = self._ended, []
        for request, error in ended:
            request.out.put(error if error is not None else DONE)

    def _fail_all(self, error: BaseException) -> None:
        rows, self.rows = self.rows, []
        for request in rows:
            if not request.finished:
                self._finish(request, "error", error)
        try:  # no row may keep pointing at blocks that are free now (padding writes there)
            for row in range(len(rows)):
                self.runner.clear_row(row)
        except Exception:  # noqa: BLE001 - the device itself failed: the next load starts anew
            log.exception("clearing the rows after a failure failed")


@dataclass(eq=False)
class _Launched:
    rows: list[Request]  # the rows of the step, in order
    read: Callable[[], list[int]]  # their tokens, once the step has run
