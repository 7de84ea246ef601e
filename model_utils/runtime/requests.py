"""One reply in the batch scheduler: what was asked, how far it got, and the stream it feeds.

Plain Python (no tensors): the scheduler decides with these; the runner keeps each request's
device state (its sampler) apart, keyed by the request.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from model_utils.runtime.generation_settings import GenerationSettings
    from model_utils.runtime.reply_stats import ReplyStats

    from .grammar import Constraint
    from .sampling import TopK


class _Done:
    """The end of a reply's stream (an exception in its place ends it with that error)."""


DONE = _Done()


@dataclass(eq=False)
class Request:
    input_ids: list[int]
    settings: GenerationSettings
    eos_ids: set[int]
    stop: threading.Event
    stats: ReplyStats
    arrived: float = field(default_factory=time.perf_counter)
    # Token ids for the reader, then DONE or the exception that ended the reply.
    out: queue.SimpleQueue[int | BaseException | _Done] = field(
        default_factory=queue.SimpleQueue)
    # Logprob checks (bench/logprob_check.py): when a list, the runner appends for each sampled
    # token the top sampling.LOGPROBS_K (log-probabilities, token ids) of its raw logits.
    logprobs: list[TopK] | None = None
    logprob_k: int = 5  # alternatives per token in `logprobs` (sampling.LOGPROBS_K)
    chosen: list | None = None  # with `logprobs`: each drawn token's log-probability
    # A format the reply must follow (grammar.py): the runner masks its logits with it, and
    # each token handed out moves it on, before the next one is sampled.
    constraint: Constraint | None = None
    new_tokens: int = 0  # handed to the reader
    sampled: int = 0  # sampled on the device: new_tokens plus those of a step in flight
    first_at: float = 0.0
    length: int = 0  # tokens in the cache, counting a step in flight
    output: list[int] = field(default_factory=list)  # the reply's tokens handed out so far
    # The KV cache (kv_blocks.BlockPool): the blocks of the request's tokens, in order, and
    # how many prompt tokens were found there (a reused prefix) when it was admitted.
    blocks: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    preempted: int = 0  # times its blocks were taken back to let others go on
    admitted: int = -1  # its place in the order of admission (the last one is preempted first)

    # What a prefill computes: the prompt, and after a preemption the reply so far too.
    prompt_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prompt_ids = self.prompt_ids or self.input_ids

    def cached_sequence(self) -> list[int]:
        """The tokens whose keys and values are in the cache, in order: the prompt and every
        reply token that was fed to a step (a token sampled after the last step is not)."""
        return (self.input_ids + self.output)[:self.length]

    @property
    def finished(self) -> bool:
        return bool(self.stats.finish_reason)

    def accept(self, token: int) -> str:
        """Account for one sampled token and hand it on; returns why the reply ends with it
        ("eos", "length", "stop") or "" when it goes on. Same bookkeeping as
        generation.decode_tokens, so the stats mean the same on both paths."""
        stats, n = self.stats, self.new_tokens
        now = time.perf_counter()
        if n == 0:
            self.first_at = now
            # From the request's arrival: a reply that waited for a row waited for real.
            stats.ttft_ms = (now - self.arrived) * 1000
        else:
            stats.tok_s = n / max(now - self.first_at, 1e-9)
        stats.total_s = now - self.arrived
        if token in self.eos_ids:
            return "eos"
        if self.constraint is not None:
            self.constraint.accept(token)
        self.new_tokens = stats.new_tokens = n + 1
        self.output.append(token)
        self.out.put(token)
        if self.new_tokens >= self.settings.max_new_tokens:
            return "length"
        if self.stop.is_set():
            return "stop"
        return ""

    def mark_finished(self, reason: str) -> None:
        stats = self.stats
        stats.finish_reason = reason
        stats.stopped = reason == "stop"
        stats.total_s = time.perf_counter() - self.arrived

    def tokens(self) -> Iterator[int]:
        """The reply's token ids as the scheduler hands them out; raises the error that ended
        it, if one did."""
        while True:
            item = self.out.get()
            if item is DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
