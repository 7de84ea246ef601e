"""Timing the engine's decode path and plain model.generate on the same prompts.

Every measured call is first run once untimed with the same prompts (warm_engine, and a short
generate before each plain one): the first batched replies of a process pay one-time costs
(thread pools, kernels chosen for a new shape, the allocator), which otherwise landed in
whichever mode was measured first (on the CPU fp32 at 4 concurrent requests read 0.05x of plain
generate first and 0.95x when measured again in the same process).

`run_peer(fn)` runs fn(should_yield) where the caller wants plain generate to run (the decode
worker when the model is shared with users, see gate.py) and returns None when it gave way.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable

import torch

from model_utils.engine import Engine, eos_ids
from model_utils.memory import GB
from model_utils.runtime.decoders import input_device
from model_utils.runtime.generation import decode_tokens
from model_utils.runtime.reply_stats import ReplyStats

from .logprob_runs import greedy_settings as greedy

log = logging.getLogger(__name__)
PeerRunner = Callable[[Callable[[Callable[[], bool]], object]], object]


def run_here(fn):
    return fn(lambda: False)


def reset_peaks() -> None:
    for i in range(torch.cuda.device_count()):
        torch.cuda.reset_peak_memory_stats(i)


def peaks_gb(reserved: bool = False) -> dict:
    if not torch.cuda.is_available():
        import psutil

        return {} if reserved else {"cpu_rss": round(psutil.Process().memory_info().rss / GB, 3)}
    peak = torch.cuda.max_memory_reserved if reserved else torch.cuda.max_memory_allocated
    return {f"cuda:{i}": round(peak(i) / GB, 3) for i in range(torch.cuda.device_count())}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# -- the engine ---------------------------------------------------------------------------------
def engine_decode(engine: Engine, prompt: list[int], new_tokens: int) -> tuple[list[int], ReplyStats]:
    """One greedy reply on the engine's own decode path: its batch scheduler (or, for a model
    it cannot batch, the single-stream decoder on its worker thread)."""
    loaded, scheduler = engine.manager.loaded, engine.serving.scheduler
    stats = ReplyStats()
    if scheduler is not None:
        tokens = list(scheduler.submit(prompt, greedy(new_tokens), eos_ids=eos_ids(loaded),
                                       stop=threading.Event(), stats=stats))
        return tokens, stats
    tokens = engine.worker.call(lambda: list(decode_tokens(
        engine.decoder_for(loaded), prompt, greedy(new_tokens), eos_ids=eos_ids(loaded),
        stats=stats)))
    return tokens, stats


def engine_concurrent(engine: Engine, prompts: list[list[int]], new_tokens: int,
                      at_once: int | None = None) -> dict:
    """len(prompts) requests submitted at once through the engine, one thread each (at most
    `at_once` in flight together, the rest waiting for one to end): aggregate tokens/s (wall
    time from the first submission to the last token), median TTFT, and every stream's
    tokens."""
    results = [None] * len(prompts)
    places = threading.BoundedSemaphore(at_once or len(prompts))

    def one(i):
        with places:
            results[i] = engine_decode(engine, prompts[i], new_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    return {"aggregate": sum(len(r[0]) for r in results) / elapsed,
            "ttft_ms": statistics.median(r[1].ttft_ms for r in results),
            "tokens": [r[0] for r in results],
            "batched_with": max(r[1].batched_with for r in results)}


def warm_engine(engine: Engine, prompts: list[list[int]], batches: list[int],
                new_tokens: int, at_once: int | None = None) -> None:
    """Every path a timed run takes, once, untimed: the batched step for each row bucket up to
    the largest batch (compiled and captured on a GPU), then one reply alone and each batch of
    concurrent requests on the very prompts that will be timed."""
    scheduler = engine.serving.scheduler
    if scheduler is not None:
        counts = range(1, max(batches) + 1)
        engine.worker.call(lambda: scheduler.runner.warm_up(counts))
    tokens = max(8, min(new_tokens, 32))
    engine_decode(engine, prompts[0], tokens)
    for b in batches:
        if b > 1:
            engine_concurrent(engine, prompts[:b], tokens, at_once)


def engine_streaming_tok_s(engine: Engine, new_tokens: int) -> float:
    """Decode tokens/s as a chat client sees them: through engine.chat (worker thread, queue,
    detokenization, reasoning split), from the first token to the last update received."""
    messages = [{"role": "user", "content": "Tell me a long story about the sea. " * 8}]
    start = time.perf_counter()
    final = None
    for final in engine.chat(messages, greedy(new_tokens), thinking=False):
        pass
    last = time.perf_counter()
    decode_s = last - start - final.stats.ttft_ms / 1000
    return (final.stats.new_tokens - 1) / max(decode_s, 1e-9)


def measure_engine(engine: Engine, prompts: list[list[int]], batches: list[int],
                   new_tokens: int, match_prompts: int, *,
                   before: Callable[[], None] = lambda: None,
                   at_once: int | None = None) -> dict[int, dict]:
    """`before()` runs ahead of each timed run (waits for a quiet engine in the UI);
    `at_once`: the most requests in flight together (the UI keeps places for users)."""
    before()
    warm_engine(engine, prompts, batches, new_tokens, at_once)
    runs_by_batch = {}
    for b in batches:
        before()
        if b == 1:
            runs = [engine_decode(engine, prompts[i], new_tokens) for i in range(match_prompts)]
            tok_s = statistics.median(r[1].tok_s for r in runs)
            runs_by_batch[1] = {"tokens": [r[0] for r in runs], "tok_s": tok_s,
                                "aggregate": tok_s,
                                "ttft_ms": statistics.median(r[1].ttft_ms for r in runs)}
        else:
            run = engine_concurrent(engine, prompts[:b], new_tokens, at_once)
            singles = runs_by_batch.get(1, {}).get("tokens", [])
            runs_by_batch[b] = {"aggregate": run["aggregate"], "tok_s": run["aggregate"] / b,
                                "ttft_ms": run["ttft_ms"],
                                "batch_match": all(x == y for x, y in zip(run["tokens"], singles))
                                if singles else None}
            log.info("batch %d: %.1f tok/s aggregate, at most %d replies per step", b,
                     run["aggregate"], run["batched_with"])
    return runs_by_batch


# -- plain generate -----------------------------------------------------------------------------
def _generate(model, ids, new_tokens: int, should_yield, **extra):
    from .gate import stopping_when

    criteria, criterion = stopping_when(should_yield)
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids),
                         stopping_criteria=criteria, **extra)
    sync()
    return None if criterion.yielded else out


def peer_generate(model, prompts: list[list[int]], new_tokens: int,
                  should_yield=lambda: False) -> tuple[list, float, float] | None:
    """Plain model.generate on a batch: (tokens, ttft_ms, per-stream decode tok/s); None when
    it gave way to a reply (see gate.py)."""
    ids = torch.tensor(prompts, device=input_device(model))
    with torch.inference_mode():
        # Warm-up (cuBLAS handles, allocator), then one token alone for the time to first token.
        if _generate(model, ids, 2, should_yield) is None:
            return None
        start = time.perf_counter()
        if _generate(model, ids, 1, should_yield) is None:
            return None
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        out = _generate(model, ids, new_tokens, should_yield)
        total = time.perf_counter() - start
    if out is None:
        return None
    tokens = out[:, ids.shape[1]:].tolist()
    return tokens, ttft * 1000, (new_tokens - 1) / max(total - ttft, 1e-9)


def peer_static_tokens(model, prompt: list[int], new_tokens: int,
                       should_yield=lambda: False) -> list[int] | None:
    """Greedy tokens of model.generate with transformers' own static KV cache, uncompiled."""
    ids = torch.tensor([prompt], device=input_device(model))
    with torch.inference_mode():
        out = _generate(model, ids, new_tokens, should_yield, cache_implementation="static",
                        disable_compile=True)
    return None if out is None else out[0, ids.shape[1]:].tolist()


def measure_peer(model, prompts: list[list[int]], batches: list[int], new_tokens: int,
                 match_prompts: int, run_peer: PeerRunner = run_here) -> dict[int, dict]:
    def gen(batch):
        return run_peer(lambda y: peer_generate(model, batch, new_tokens, y))

    runs_by_batch = {}
    for b in batches:
        if b == 1:
            runs = [gen([prompts[i]]) for i in range(match_prompts)]
            tok_s = statistics.median(r[2] for r in runs)
            static = [run_peer(lambda y, i=i: peer_static_tokens(model, prompts[i], new_tokens,
                                                                 y))
                      for i in range(match_prompts)]
            runs_by_batch[1] = {"tokens": [r[0][0] for r in runs], "tok_s": tok_s,
                                "aggregate": tok_s,
                                "ttft_ms": statistics.median(r[1] for r in runs),
                                "static_tokens": static}
        else:
            _, ttft, tok_s = gen(prompts[:b])
            runs_by_batch[b] = {"ttft_ms": ttft, "tok_s": tok_s, "aggregate": tok_s * b}
    return runs_by_batch


def settle(engine: Engine, stall_s: float = 60.0) -> None:
    """Wait until what the load left for the decode worker's idle time (prefill graphs, a
    deferred compile) and the spare parking buffer it started (--park-gb) are done:
    measurements of steady serving start after it (the app never waits for it). Gives up after
    `stall_s` without progress (a job that failed is logged)."""
    engine.manager.parked.wait()
    serving = engine.serving
    left, since = None, time.monotonic()
    while serving is not None and (now := serving.idle_work_left()):
        if now != left:
            left, since = now, time.monotonic()
        elif time.monotonic() - since > stall_s:
            log.warning("%d graphs left for idle time were not set up: measuring without "
                        "them", left)
            return
        engine.worker.call(lambda: None)  # behind the next job that sets up a shape
        time.sleep(0.01)
