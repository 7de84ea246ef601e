"""Continuous batching: concurrent replies decoded together, each streaming its own tokens.

Why our own scheduler: transformers' continuous batching (generate_batch, paged attention) was
measured on an H200 at 332 tok/s aggregate for 32 requests, against a target of 3000; it also
runs its own thread and cache, where our CUDA graphs must stay on the engine's decode worker. So
the loop below is ours; the model, its StaticLayer cache and its masks are transformers' own.

The loop runs on the engine's DecodeWorker (every model call on one thread) while there is work:

    admit   waiting requests take free rows: their prompts are prefilled (together, left-
            padded, when several wait; alone it is the very forward of a single reply), each
            first token sampled, each prompt's KV copied into its row of the batch cache
    drop    requests whose stop event is set (Stop, a closed tab, a vanished client) leave
    step    one forward for all active rows (batch_cache.BatchKV), then each row is sampled
            with its own settings, its token pushed to its own queue; finished rows leave

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

from .batch_cache import BatchKV, bucket, kv_bytes_per_row
from .decoders import input_device
from .generation import GenerationSettings, ReplyStats, sample_next
from .manager import ModelBusy

log = logging.getLogger(__name__)

MAX_BATCH_LIMIT = 64
# Share of the memory free after loading that the batch KV cache may take (per device).
KV_MEMORY_SHARE = 0.5
# Most (padded) prompt tokens prefilled in one forward: bounds its activation memory.
PREFILL_TOKENS = 8192
_DONE = object()


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
    new_tokens: int = 0
    first_at: float = 0.0
    last_token: int = 0  # sampled, not yet in the cache
    length: int = 0  # tokens in the cache

    @property
    def greedy(self) -> bool:
        return self.settings.temperature == 0 and self.settings.repetition_penalty == 1.0


class BatchScheduler:
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

    @staticmethod
    def check_limits(max_batch: int, max_queue: int) -> None:
        if not isinstance(max_batch, int) or not 1 <= max_batch <= MAX_BATCH_LIMIT:
            raise ValueError(f"max_batch must be between 1 and {MAX_BATCH_LIMIT}, got {max_batch}")
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")

    # -- any thread ---------------------------------------------------------------------------
    def submit(self, input_ids: list[int], settings: GenerationSettings, *, eos_ids: set[int],
               stop: threading.Event, stats: ReplyStats) -> Iterator[int]:
        """Queue one reply; returns the iterator of its token ids. Raises QueueFull when
        max_batch replies are decoding and max_queue more are waiting."""
        if not input_ids or len(input_ids) + settings.max_new_tokens > self.context_tokens:
            # Checked here: a reply that outgrew its row would fail the whole batch's step.
            raise ValueError(f"{len(input_ids)} prompt tokens + max_new_tokens "
                             f"{settings.max_new_tokens} do not fit the context window "
                             f"({self.context_tokens}), or the prompt is empty")
        request = Request(list(input_ids), settings, set(eos_ids), stop, stats)
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
        from transformers import DynamicCache

        with torch.inference_mode():
            if self.kv is None:
                cache = DynamicCache(config=self.model.config)
                ids = torch.zeros(1, 16, dtype=torch.long, device=self.device)
                self.model(input_ids=ids, position_ids=torch.arange(16, device=self.device)[None],
                           cache=cache, use_cache=True, logits_to_keep=1)
                self.kv = self._allocate(cache)
            kv = self.kv
            for b in sorted({bucket(min(r, kv.rows), kv.row_buckets) for r in row_counts}):
                kv.relayout(0, 0)
                kv.prepare_step([0] * b, 0)
                self.step_fn(kv, b, kv.windows[0])
            kv.relayout(0, 0)

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
                    self._step()
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

    def _admit(self) -> None:
        """Give free rows to waiting requests; their prompts are prefilled together."""
        capacity = self.kv.rows if self.kv else self.max_batch
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
        for chunk in _prefill_chunks(starting):
            try:
                self._prefill(chunk)
            except Exception as error:  # noqa: BLE001 - these requests fail, the others go on
                log.exception("prefill failed")
                with self._lock:
                    requeued = set(self._waiting)
                for request in chunk:  # those not already placed, ended or sent back to wait
                    if request not in self.rows and not request.stats.finish_reason \
                            and request not in requeued:
                        self._finish(request, "error", error)

    def _prefill(self, requests: list[Request]) -> None:
        """Prefill prompts in one forward (left-padded when several), sample each one's first
        token, and copy each one's KV into a free row of the batch cache.

        One prompt alone runs exactly the forward of a single-stream reply (no mask, no
        padding); several share one forward, which is what keeps the time to first token
        short when many requests arrive at once (each prefill is a full pass over the weights).
        """
        from transformers import DynamicCache

        for request in requests:
            settings = request.settings
            if settings.seed is not None and settings.temperature > 0:
                request.generator = torch.Generator(device=self.device).manual_seed(
                    settings.seed)
            if settings.repetition_penalty != 1.0:
                request.seen = torch.tensor(request.input_ids, dtype=torch.long,
                                            device=self.device)
        lengths = [len(r.input_ids) for r in requests]
        width = max(lengths)
        ids = torch.zeros(len(requests), width, dtype=torch.long)
        positions = torch.zeros(len(requests), width, dtype=torch.long)
        mask = torch.zeros(len(requests), width, dtype=torch.long)
        for i, (request, length) in enumerate(zip(requests, lengths)):
            ids[i, width - length:] = torch.tensor(request.input_ids)
            positions[i, width - length:] = torch.arange(length)
            mask[i, width - length:] = 1
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids.to(self.device), position_ids=positions.to(self.device),
                         attention_mask=mask.to(self.device) if len(requests) > 1 else None,
                         cache=cache, use_cache=True, logits_to_keep=1)
        if self.kv is None:
            self.kv = self._allocate(cache)
        # Memory may give the cache fewer rows than max_batch: the surplus waits again.
        keep = self.kv.rows - len(self.rows)
        if keep < len(requests):
            with self._lock:
                self._waiting.extendleft(reversed(requests[keep:]))
                self._admitted -= len(requests) - keep
            requests, lengths = requests[:keep], lengths[:keep]
        tokens = self._sample(out.logits[:len(requests), -1], requests)
        for i, (request, token, length) in enumerate(zip(requests, tokens, lengths)):
            if not self._accept(request, token):
                continue
            request.length = length
            self.kv.place(len(self.rows), cache, length, len(self.rows), source=i)
            self.rows.append(request)
        self.peak_rows = max(self.peak_rows, len(self.rows))

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
        return BatchKV(self.model, prompt_cache, rows=rows, length=self.context_tokens,
                       device=self.device)

    def _step(self) -> None:
        kv = self.kv
        b, w = kv.prepare_step([r.last_token for r in self.rows],
                               max(r.length for r in self.rows))
        logits = self.step_fn(kv, b, w)  # [b, V]
        kv.advance(b)
        for request in self.rows:
            request.length += 1
            request.stats.batched_with = max(request.stats.batched_with, len(self.rows))
        tokens = self._sample(logits[:len(self.rows)], self.rows)
        # Every row is pushed before any leaves, so that a finished row's move does not
        # reorder rows still to be sampled.
        done = [i for i, (r, t) in enumerate(zip(self.rows, tokens)) if not self._accept(r, t)]
        self._drop(done, finished=True)

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """logits [n, V] -> one token per request, each with its own settings.

        Greedy rows (the common case for benchmarks, and what the equality tests compare) are
        one argmax and one host sync for all of them; others go through sample_next, the same
        function a single reply uses.
        """
        masked = [i for i, r in enumerate(requests)
                  if r.new_tokens < r.settings.min_new_tokens and r.eos_ids]
        if masked:
            logits = logits.float()
            eos = torch.tensor(sorted(requests[masked[0]].eos_ids), device=logits.device)
            rows = torch.tensor(masked, device=logits.device)
            logits[rows[:, None], eos[None, :]] = -math.inf
        tokens: list[int | None] = [None] * len(requests)
        greedy = [i for i, r in enumerate(requests) if r.greedy]
        if greedy:
            picked = logits.argmax(-1) if len(greedy) == len(requests) else \
                logits[torch.tensor(greedy, device=logits.device)].argmax(-1)
            for i, token in zip(greedy, picked.tolist()):
                tokens[i] = token
        for i, request in enumerate(requests):
            if tokens[i] is None:
                seen = request.seen if request.seen is not None else logits.new_empty(0).long()
                tokens[i] = sample_next(logits[i], request.settings, seen, request.generator)
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
        request.last_token = token
        request.out.put(token)
        if request.seen is not None:
            request.seen = torch.cat([request.seen, request.seen.new_tensor([token])])
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
            self._finish(request, "error", error)
        self.rows = []


class EagerStep:
    """One decode step for rows [0, b) on the model's own forward: logits [b, V]."""

    name = "eager"

    def __init__(self, model):
        self.model = model

    def __call__(self, kv: BatchKV, b: int, w: int) -> torch.Tensor:
        return self.model(**kv.inputs(b, w)).logits[:, -1]


def _prefill_chunks(requests: list[Request]) -> Iterator[list[Request]]:
    """Groups of requests prefilled in one forward: at most PREFILL_TOKENS padded tokens."""
    chunk: list[Request] = []
    for request in sorted(requests, key=lambda r: len(r.input_ids)):
        width = len(request.input_ids)  # the longest so far, as the list is sorted
        if chunk and (len(chunk) + 1) * width > PREFILL_TOKENS:
            yield chunk
            chunk = []
        chunk.append(request)
    if chunk:
        yield chunk


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
