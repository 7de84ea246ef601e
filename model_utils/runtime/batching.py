"""Continuous batching: concurrent replies decoded together, each streaming its own tokens.

Why our own scheduler: transformers' continuous batching (generate_batch, paged attention) was
measured on an H200 at 332 tok/s aggregate for 32 requests, against a target of 3000; it also
runs its own thread and cache, where our CUDA graphs must stay on the engine's decode worker. So
the loop below is ours; the model, its StaticLayer cache and its masks are transformers' own.

The loop runs on the engine's DecodeWorker (every model call on one thread) while there is work:

    admit   waiting requests take free rows: their prompts are prefilled (on a GPU by CUDA graph
            replays, up to 8 prompts each, see _prefill_groups; else together, left-padded, when
            several wait), each first token sampled, each prompt's KV copied into its row
    drop    requests whose stop event is set (Stop, a closed tab, a vanished client) leave
    step    one forward for all active rows (batch_cache.BatchKV), then each row is sampled
            with its own settings, on the device: the sampled tokens are the next step's inputs
            there, and the next step is launched before the host reads them (it pushes each
            token to its request's queue while the GPU runs the step after), so the GPU does
            not wait for Python between steps; finished rows leave

so a request joins or leaves between two steps and never waits for the batch to finish. The
number of requests admitted or waiting is bounded (max_batch + max_queue): one more gets
QueueFull at once, never a hang.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from model_utils.loading.manager import ModelBusy

from .batch_admission import Admission
from .batch_cache import BatchKV, bucket, kv_bytes_per_row
from .decoders import input_device
from .generation import GenerationSettings, ReplyStats
from .prefill import PaddedPrefill
from .sampling import is_greedy, sample_token

log = logging.getLogger(__name__)

MAX_BATCH_LIMIT = 64
# Share of the memory free after loading that the batch KV cache may take (per device).
KV_MEMORY_SHARE = 0.5
_DONE = object()
LOGPROBS_K = 5  # top-k kept per token for a request that records logprobs


class QueueFull(ModelBusy):
    """Too many requests in flight: the caller should say "busy, try again shortly".
    A ModelBusy, so a front end that already presents ModelBusy presents this too."""


@dataclass(eq=False)
class Request:
    input_ids: list[int]
    settings: GenerationSettings
    eos_ids: set[int]
    stop: threading.Event
    stats: ReplyStats
    arrived: float = field(default_factory=time.perf_counter)
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    generator: torch.Generator | None = None
    seen: torch.Tensor | None = None  # prompt + reply ids, for the repetition penalty
    eos: torch.Tensor | None = None  # eos_ids on the device, for min_new_tokens
    new_tokens: int = 0  # handed to the reader
    sampled: int = 0  # sampled on the device: new_tokens plus those of a step in flight
    first_at: float = 0.0
    length: int = 0  # tokens in the cache, counting a step in flight
    # Logprob checks (logprob_check.py): when a list, each sampled token appends the top
    # LOGPROBS_K (log-probabilities, token ids) of its raw logits, on the device.
    logprobs: list | None = None

    @property
    def finished(self) -> bool:
        return bool(self.stats.finish_reason)

    @property
    def greedy(self) -> bool:
        return is_greedy(self.settings) and self.settings.repetition_penalty == 1.0


class BatchScheduler(Admission):
    """Decodes the requests of one loaded model together. Thread-safe `submit`; the loop runs
    on `post`'s thread (the engine's DecodeWorker)."""

    def __init__(self, model, *, post: Callable[[Callable[[], None]], None], context_tokens: int,
                 max_batch: int = 8, max_queue: int = 64, step_fn=None, path_name: str = "eager"):
        self.check_limits(max_batch, max_queue)
        self.model = model
        self.post = post
        self.context_tokens = context_tokens
        self.max_batch, self.max_queue = max_batch, max_queue
        # step_fn(kv, b, w) -> logits [b, V]: the eager forward, or fast_path's captured graphs.
        self.step_fn = step_fn or EagerStep(model)
        self.path_name = path_name
        self.device = input_device(model)
        self.kv: BatchKV | None = None  # allocated at the first request (sized by its KV)
        self.rows: list[Request] = []  # active requests; rows[i] decodes in cache row i
        self._waiting: deque[Request] = deque()
        self._lock = threading.Lock()
        self._admitted = 0  # requests taken off the queue and not finished (under _lock)
        self._running = False  # the loop is posted or running (under _lock)
        self.peak_rows = 0
        self._ended: list[tuple[Request, object]] = []  # (request, its end marker), see _finish
        self._readback: TokenReadback | None = None  # made with the cache
        self.padded_prefill: PaddedPrefill | None = None  # see use_padded_prefill

    @staticmethod
    def check_limits(max_batch: int, max_queue: int) -> None:
        if not isinstance(max_batch, int) or not 1 <= max_batch <= MAX_BATCH_LIMIT:
            raise ValueError(f"max_batch must be between 1 and {MAX_BATCH_LIMIT}, got {max_batch}")
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")

    # -- any thread ---------------------------------------------------------------------------
    def submit(self, input_ids: list[int], settings: GenerationSettings, *, eos_ids: set[int],
               stop: threading.Event, stats: ReplyStats,
               logprobs: list | None = None) -> Iterator[int]:
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
        return _tokens(request)

    def warm_up(self, row_counts=(1,)) -> None:
        """Compile and capture the step for the row buckets of `row_counts` ahead of any reply,
        so that a new batch size does not stall the replies decoding. Call on the worker
        thread (engine.worker.call), where no loop is running: it uses the cache's rows."""
        with torch.inference_mode():
            if self.kv is None:
                _, cache = self._forward_prompts([[0] * 16])
                self.kv = self._allocate(cache)
                # The first masked forward of several prompts (eager groups: the CPU, and
                # prompts longer than the prefill graphs) has first-call costs of its own.
                self._forward_prompts([[0] * 16, [0] * 12])
            kv = self.kv
            for b in sorted({bucket(min(r, kv.rows), kv.row_buckets) for r in row_counts}):
                kv.relayout(0, 0)
                kv.prepare_step(b, 0)
                self.step_fn(kv, b, kv.windows[0])
            kv.relayout(0, 0)

    def use_padded_prefill(self, capture=None) -> float:
        """Prefill short prompts through prefill.PaddedPrefill (captured as CUDA graphs by
        `capture`, a fast_path.GraphCapture; eager without), set up now; returns the seconds it
        took. On the worker thread, after warm_up (which allocates the cache)."""
        padded = PaddedPrefill(self.model, self.kv, capture=capture)
        if not padded.buckets:  # a context shorter than the smallest bucket
            return 0.0
        with torch.inference_mode():
            seconds = padded.warm_up()
        self.padded_prefill = padded
        return seconds

    def cache_bytes(self) -> int:
        """Bytes of the caches replies decode in: the batch cache and the prefill row."""
        return (self.kv.nbytes if self.kv else 0) + \
            (self.padded_prefill.nbytes if self.padded_prefill else 0)

    def load(self) -> dict:
        with self._lock:
            return {"active": self._admitted, "waiting": len(self._waiting),
                    "max_batch": self.max_batch, "max_queue": self.max_queue}

    # -- the decode worker --------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            with torch.inference_mode():
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

    def _allocate(self, prompt_cache) -> BatchKV:
        """The batch cache: max_batch rows of context_tokens slots, fewer if memory is short."""
        per_row = kv_bytes_per_row(prompt_cache, self.context_tokens)
        rows = self.max_batch
        for device, size in per_row.items():
            free = _free_bytes(device)
            rows = min(rows, max(1, int(free * KV_MEMORY_SHARE // size)))
        if rows < self.max_batch:
            log.warning("batch cache: memory for %d of %d rows of %d tokens", rows,
                        self.max_batch, self.context_tokens)
        log.info("batch cache: %d rows x %d tokens, %.3f GB", rows, self.context_tokens,
                 rows * sum(per_row.values()) / 2**30)
        self._readback = TokenReadback(self.device, rows)
        return BatchKV(self.model, prompt_cache, rows=rows, length=self.context_tokens,
                       device=self.device)

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
        for the device. The tokens become the next step's inputs on the device."""
        kv, rows = self.kv, list(self.rows)
        b, w = kv.prepare_step(len(rows), max(r.length for r in rows))
        logits = self.step_fn(kv, b, w)  # [b, V]
        kv.advance(b)
        for request in rows:
            request.length += 1
            request.stats.batched_with = max(request.stats.batched_with, len(rows))
        tokens = self._sample(logits[:len(rows)], rows)
        kv.ids[:len(rows), 0].copy_(tokens)
        return _Launched(rows, self._readback.start(tokens))

    def _collect(self, launched: _Launched) -> None:
        """Hand out the tokens of a launched step (waiting for it if it still runs)."""
        for request, token in zip(launched.rows, launched.read()):
            if not request.finished:  # a row that ended one step earlier: its token is void
                self._accept(request, token)

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """logits [n, V] -> one token per request on the device, each with its own settings.

        Greedy rows (the common case for benchmarks, and what the equality tests compare) are
        one argmax for all of them; others go through sample_token, the same function a single
        reply uses. The repetition penalty's record of seen tokens grows here, on the device.
        A row whose sampling raises ends alone (its request gets the error); its slot keeps the
        greedy token so the step's tensors stay whole, and it leaves before the next step.
        """
        for i, request in enumerate(requests):
            if request.logprobs is not None:
                request.logprobs.append(torch.log_softmax(logits[i].float(), -1).topk(LOGPROBS_K))
        masked = [i for i, r in enumerate(requests)
                  if r.sampled < r.settings.min_new_tokens and r.eos is not None]
        if masked:
            logits = logits.float()
            for i in masked:
                logits[i].index_fill_(0, requests[i].eos, -math.inf)
        # A NaN row's argmax is still some token id: nothing to guard for the greedy rows (and
        # no extra pass over [rows, vocabulary] each step); sample_token guards its own.
        tokens = logits.argmax(-1)
        for i, request in enumerate(requests):
            if request.finished:  # ended in an earlier step still being read: its token is void
                continue
            request.sampled += 1
            try:
                if not request.greedy:
                    seen = request.seen if request.seen is not None else tokens.new_empty(0)
                    tokens[i] = sample_token(logits[i], request.settings, seen,
                                             request.generator)
                if request.seen is not None:
                    request.seen = torch.cat([request.seen, tokens[i:i + 1]])
            except Exception as error:  # noqa: BLE001 - this row fails, the others go on
                log.error("sampling failed for one reply: %s", error, exc_info=error)
                self._finish(request, "error", error)
        return tokens

    def _accept(self, request: Request, token: int) -> bool:
        """Account for one sampled token and hand it on; False when the request is done.
        Same bookkeeping as generation.decode_tokens, so stats mean the same."""
        stats, n = request.stats, request.new_tokens
        now = time.perf_counter()
        if n == 0:
            request.first_at = now
            # From the request's arrival: a reply that waited for a row waited for real.
            stats.ttft_ms = (now - request.arrived) * 1000
        else:
            stats.tok_s = n / max(now - request.first_at, 1e-9)
        stats.total_s = now - request.arrived
        if token in request.eos_ids:
            self._finish(request, "eos")
            return False
        request.new_tokens = stats.new_tokens = n + 1
        request.out.put(token)
        if request.new_tokens >= request.settings.max_new_tokens:
            self._finish(request, "length")
            return False
        if request.stop.is_set():
            self._finish(request, "stop")
            return False
        return True

    def _drop(self, indices, *, finished: bool = False) -> None:
        """Free the rows at `indices`; the last active row moves into each hole."""
        for i in sorted(indices, reverse=True):
            request = self.rows[i]
            if not finished:
                self._finish(request, "stop")
            last = len(self.rows) - 1
            if i != last:
                self.kv.move_row(last, i, self.rows[last].length)
                self.rows[i] = self.rows[last]
            self.rows.pop()

    def _finish(self, request: Request, reason: str, error: BaseException | None = None) -> None:
        stats = request.stats
        stats.finish_reason = reason
        stats.stopped = reason == "stop"
        stats.total_s = time.perf_counter() - request.arrived
        with self._lock:
            self._admitted -= 1
        self._ended.append((request, error if error is not None else _DONE))

    def _flush_ended(self) -> None:
        """End the streams of requests finished in this iteration. Deferred to its end, after
        this iteration's last tensor work (rows moving), so that a caller that exits as soon as
        its reply ends (the CLI) never tears the process down under a running torch op."""
        ended, self._ended = self._ended, []
        for request, marker in ended:
            request.out.put(marker)

    def _fail_all(self, error: BaseException) -> None:
        for request in self.rows:
            if not request.finished:
                self._finish(request, "error", error)
        self.rows = []


@dataclass(eq=False)
class _Launched:
    rows: list[Request]  # the rows of the step, in order
    read: Callable[[], list[int]]  # their tokens, once the step has run


class TokenReadback:
    """Copies a step's sampled tokens to the host without stopping the device.

    On CUDA the copy goes into one of two pinned buffers (at most two steps are in flight)
    and an event marks when it has landed; reading waits for that event only, while the
    step launched after it keeps the GPU busy. The events block rather than spin: the
    waiting thread sleeps instead of burning a CPU core that the web server's threads need,
    and the moment it takes to wake up is hidden behind the step already queued. On the CPU
    the tokens are there already.
    """

    def __init__(self, device: torch.device, rows: int):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.buffers = [torch.empty(rows, dtype=torch.long, pin_memory=True)
                            for _ in range(2)]
            self.events = [torch.cuda.Event(blocking=True), torch.cuda.Event(blocking=True)]
            self.turn = 0

    def start(self, tokens: torch.Tensor) -> Callable[[], list[int]]:
        if not self.cuda:
            return tokens.tolist
        buffer, event = self.buffers[self.turn][:len(tokens)], self.events[self.turn]
        self.turn ^= 1
        buffer.copy_(tokens, non_blocking=True)
        event.record()

        def read() -> list[int]:
            event.synchronize()
            return buffer.tolist()

        return read


class EagerStep:
    """One decode step for rows [0, b) on the model's own forward: logits [b, V]."""

    name = "eager"

    def __init__(self, model):
        self.model = model

    def __call__(self, kv: BatchKV, b: int, w: int) -> torch.Tensor:
        return self.model(**kv.inputs(b, w)).logits[:, -1]


def _tokens(request: Request) -> Iterator[int]:
    while True:
        item = request.out.get()
        if item is _DONE:
            return
        if isinstance(item, BaseException):
            raise item
        yield item


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    import psutil

    return psutil.virtual_memory().available
