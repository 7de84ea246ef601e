"""The fast path for single-stream decoding on a CUDA GPU: static KV cache + CUDA graphs.

Plain model.generate spends most of each token launching kernels from Python (a 7B model decodes
at 4-15 % of the H200's memory-bandwidth bound). Here the decode step has fixed shapes (one token
per row, a preallocated cache of a bucketed length), so it is torch.compile'd once, captured as a
CUDA graph, and every later token is one graph replay (GraphedStep for a single-stream decoder,
GraphedBatchStep for the batch scheduler, which serves every reply of a model it can batch).

It applies only where it can: one CUDA device holding every weight, a mode that compiles. Else the
eager path is used and the status says why.
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import torch

from model_utils.loading.weight_only import inductor_options

from .decoders import CACHE_BUCKETS, StaticCaches, StaticDecoder

log = logging.getLogger(__name__)


def compile_forward(model, inductor_mode: str):
    """torch.compile of the model's forward for one fixed shape; a model with weight-only
    layers gets their inductor settings too (weight_only.inductor_options). torch.compile takes
    a mode or options, not both: a named mode is spelled out as its options then."""
    options = inductor_options(model)
    if not options:
        return torch.compile(model.forward, mode=inductor_mode, fullgraph=True, dynamic=False)
    if inductor_mode != "default":
        from torch._inductor import list_mode_options

        options = {**list_mode_options(inductor_mode), **options}
    return torch.compile(model.forward, options=options, fullgraph=True, dynamic=False)


def support(loaded) -> tuple[bool, str]:
    """(applies, why) for a freshly loaded model."""
    devices = set(loaded.device_map)
    if not torch.cuda.is_available():
        return False, "eager path: no CUDA GPU (the compiled path needs CUDA graphs)"
    if len(devices) != 1 or not next(iter(devices)).startswith("cuda"):
        return False, (f"eager path: the weights are spread over {', '.join(sorted(devices))}; "
                       "the compiled path needs the whole model on one GPU")
    if not loaded.mode.compiles:  # bitsandbytes' int8 breaks CUDA-graph capture
        return False, f"eager path: bitsandbytes {loaded.mode.name} does not compile to CUDA graphs"
    return True, "compiled path: static KV cache + CUDA graphs"


class GraphCapture:
    """Captures CUDA graphs for one loaded model: one memory pool, one warm-up stream.

    One pool: a graph keeps the memory of its intermediate tensors in its pool, and graphs in
    separate pools each hold their own. The decode steps and the prompt prefills are replayed
    one at a time on the decode worker and exchange data only through persistent buffers (the
    caches, ids, positions, masks, each graph's output), which stay allocated, so they can share
    one pool: its size is the largest graph's intermediates, not their sum.

    One warm-up stream: each graph is first run on a side stream (compilation, autotuning, the
    allocator), and cuBLAS keeps a workspace for every stream it has run on for the life of the
    process: a new side stream per capture held ~32 MB more GPU memory per graph (0.6 GB for the
    20 graphs of a 32-row bf16 7B model on the H200, BENCHMARKS.md runs L and M).
    """

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()
        self.side = torch.cuda.Stream()

    def __call__(self, run, restore):
        """(graph, output) of `run` captured as one CUDA graph.

        Three warm-up runs first; they move the cache's write index, so `restore` puts it back
        before the capture records the real step."""
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            for _ in range(3):
                run()
        torch.cuda.current_stream().wait_stream(self.side)
        restore()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = run()
        return graph, output


class GraphedStep:
    """The compiled forward captured by hand as one CUDA graph per static cache.

    torch.compile's own "reduce-overhead" mode also replays CUDA graphs, but it first evaluates
    dynamo's guards and copies inputs on every call, which costs about as much as the GPU work
    of a 7B decode step. A hand-held torch.cuda.CUDAGraph replays with two tiny copies
    (token, position) and nothing else. The cache's write position (cumulative_length) is a
    device tensor updated inside the graph, so each replay writes the next slot.
    """

    def __init__(self, model, inductor_mode: str = "default"):
        # "max-autotune-no-cudagraphs" benchmarks matmul kernels for each shape at warm-up:
        # longer loads, sometimes faster 1-token GEMVs. Capturing the graph stays ours.
        self.compiled = compile_forward(model, inductor_mode)
        self._graphs: dict[int, tuple] = {}
        self.capture = GraphCapture()  # every bucket's graph

    def __call__(self, *, input_ids, position_ids, cache, **_):
        entry = self._graphs.get(id(cache)) or self._capture(input_ids, position_ids, cache)
        graph, token, position, logits = entry
        token.copy_(input_ids)
        position.copy_(position_ids)
        graph.replay()
        return SimpleNamespace(logits=logits)

    def _capture(self, input_ids, position_ids, cache):
        token, position = input_ids.clone(), position_ids.clone()
        lengths = [layer.cumulative_length.clone() for layer in cache.layers]

        def run():
            return self.compiled(input_ids=token, position_ids=position, cache=cache,
                                 use_cache=True, logits_to_keep=1).logits

        def restore():  # back to where this reply stands
            for layer, length in zip(cache.layers, lengths):
                layer.cumulative_length.copy_(length)

        graph, logits = self.capture(run, restore)
        entry = (graph, token, position, logits)
        self._graphs[id(cache)] = entry
        return entry


STRATEGIES = ("graphed", "reduce-overhead", "reduce-overhead-partial")
# torch.compile modes offered for the decode step. The autotuned one benchmarks matmul kernels
# for each shape while warming up: about a minute more per load (less once inductor's cache
# has them), 200 against 192 tok/s for one bf16 7B stream on the H200 (BENCHMARKS.md, run E).
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")


class FastPath:
    """Owns the compiled step and the static caches of one loaded model."""

    def __init__(self, model, *, strategy: str = "graphed", inductor_mode: str = "default"):
        self.model = model
        self.caches = StaticCaches(model)
        self.name = f"static-cache+cuda-graphs ({strategy})"
        # Each bucket is one more compiled shape; leave room for all of them.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit,
                                                    4 * len(CACHE_BUCKETS))
        if strategy == "graphed":
            self.step_fn = GraphedStep(model, inductor_mode)
        else:
            self.step_fn = torch.compile(model.forward, mode="reduce-overhead",
                                         fullgraph=strategy == "reduce-overhead",
                                         dynamic=False)

    def decoder(self) -> StaticDecoder:
        return StaticDecoder(self.model, self.caches, self.step_fn, name=self.name)

    def warm_up(self, bucket: int, progress=None) -> float:
        """Compile and capture the step for one cache bucket; returns seconds spent."""
        start = time.perf_counter()
        decoder = self.decoder()
        prompt = [0] * 16
        # reduce-overhead compiles on the first call, records the CUDA graph on a later one
        # and replays from then on: a handful of steps gets through all three.
        steps = 6
        decoder.prefill(prompt, max_new_tokens=bucket - len(prompt))
        for i in range(steps):
            if progress:
                progress(0.6 + 0.3 * i / steps,
                         f"compiling the decode step for a {bucket}-token cache ({i + 1}/{steps})")
            decoder.step(0)
        torch.cuda.synchronize()
        return time.perf_counter() - start


def attach(loaded, progress=None, *, warm_bucket: int = 1024,
           inductor_mode: str = "default") -> None:
    """Manager hook: decide the path for a new model and warm the fast one up."""
    applies, why = support(loaded)
    loaded.decode_path_reason = why
    if not applies:
        loaded.decode_path = "eager"
        return
    error = None
    # Fastest first: one hand-captured graph; then torch's own CUDA-graph mode; then the
    # same with graph breaks allowed (several captured pieces still beat eager).
    for strategy in STRATEGIES:
        try:
            fast = FastPath(loaded.model, strategy=strategy, inductor_mode=inductor_mode)
            seconds = fast.warm_up(warm_bucket, progress)
            break
        except Exception as exc:  # noqa: BLE001 - any compile failure falls back, logged
            log.exception("compiling the decode step (%s) failed", strategy)
            error = exc
            torch._dynamo.reset()
    else:
        loaded.decode_path = "eager"
        loaded.decode_path_reason = f"eager path: compiling failed ({type(error).__name__}: " \
                                    f"{str(error).splitlines()[0][:200]})"
        return
    loaded.fast_path = fast
    loaded.decode_path = fast.name  # names the strategy that captured
    log.info("fast path ready for %s in %.1f s", loaded.display_name, seconds)


class GraphedBatchStep:
    """The batched decode step (batching.BatchScheduler) captured as one CUDA graph per view.

    Like GraphedStep, but every input is already a persistent buffer of batch_cache.BatchKV
    (ids, positions, mask, cache views): the graph reads them in place, so a replay needs no
    copies at all. One graph per (rows, slots) bucket of the view; a shape whose capture fails
    runs the plain forward uncaptured (logged): it never fails a reply.

    Which forward is captured: the torch.compile'd one for up to `compiled_rows` rows in the
    cache's first window (default 1 row: one reply decodes at 192 tok/s on the H200, bf16 7B,
    run E), the model's plain forward for any other shape (see _capture_any).
    Why not compile every batch size: on the H200 each new shape cost 43-53 s of inductor
    compilation (2, 4, ..., 32 rows, measured), which would stall every reply the first time that
    many users overlap (or add minutes to each load). A CUDA graph of the plain forward still
    removes the per-kernel launch cost, which is what made eager decoding slow: measured on the
    H200, 8.2 ms per step for 32 rows (3492 tok/s through the engine) against 5.9 ms for 8 rows
    compiled. Attention reads each KV head once in both (attention.packed_sdpa).
    """

    def __init__(self, model, inductor_mode: str = "default", compiled_rows: int = 1):
        self.model = model
        self.compiled = compile_forward(model, inductor_mode)
        self.compiled_rows = compiled_rows
        self._graphs: dict[tuple, tuple] = {}
        self.capture = GraphCapture()  # shared with the prefill graphs (engine._warm_up)
        self.failed: str | None = None
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)

    def __call__(self, kv, b: int, w: int) -> torch.Tensor:
        key = (id(kv), b, w)
        if key not in self._graphs:
            self._graphs[key] = self._capture_any(kv, b, w)
        entry = self._graphs[key]
        if entry is None:  # no graph for this shape: the plain forward, uncaptured
            return self.model(**kv.inputs(b, w)).logits[:, -1]
        graph, logits = entry
        graph.replay()
        return logits

    def _capture_any(self, kv, b: int, w: int):
        """The first forward that captures for this view, None when neither does (logged).

        The compiled one first only for up to compiled_rows rows in the cache's first window,
        the shape of nearly every short chat: any other shape would be a new compilation
        (43-53 s on the H200) while every reply waits, e.g. a conversation outgrowing 1024
        tokens; those capture the plain forward (one row: 7.05 against 5.11 ms a step).
        """
        compiled_first = b <= self.compiled_rows and w == kv.windows[0]
        forwards = [self.compiled, self.model] if compiled_first else [self.model, self.compiled]
        for forward in forwards:
            try:
                return self._capture(kv, b, w, forward)
            except Exception as error:  # noqa: BLE001 - serve eagerly rather than fail
                log.exception("capturing the batched step (%d rows, %d slots) failed", b, w)
                kv.set_index_after_capture()
                reason = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        self.failed = reason
        return None

    def _capture(self, kv, b: int, w: int, forward):
        inputs = kv.inputs(b, w)
        start = time.perf_counter()

        def run():
            return forward(**inputs).logits[:, -1]

        # The warm-up writes slots j..j+2 (each later step overwrites its slot before reading
        # it) and moves the write index, which set_index_after_capture puts back.
        graph, logits = self.capture(run, kv.set_index_after_capture)
        log.info("captured the batched step (%s) for %d rows x %d slots in %.1f s",
                 "compiled" if forward is self.compiled else "plain forward", b, w,
                 time.perf_counter() - start)
        return graph, logits
