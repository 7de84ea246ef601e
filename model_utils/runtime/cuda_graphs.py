"""The decode step on a CUDA GPU: torch.compile, and CUDA graphs captured and replayed by hand.

Plain model.generate spends most of each token launching kernels from Python (a 7B model decodes
at 4-15 % of the H200's memory-bandwidth bound). The batched decode step has fixed shapes (one
token per row, views of a preallocated cache of bucketed sizes, kv_cache.BatchKV), so each
shape is captured once as a CUDA graph (GraphedBatchStep) and every later step is one replay.
The prefill graphs (prefill.PaddedPrefill) are captured through the same GraphCapture.

It applies only where it can: one CUDA device holding every weight, a mode that compiles. Else the
eager path is used and the status says why.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from model_utils.loading.weight_only import inductor_options

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from model_utils.loading.manager import LoadedModel

    from .kv_cache import BatchKV

# A captured graph and its output buffer, which each replay overwrites.
Captured = tuple[torch.cuda.CUDAGraph, torch.Tensor]

log = logging.getLogger(__name__)


def compile_forward(model: PreTrainedModel, inductor_mode: str) -> Callable[..., Any]:
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


def support(loaded: LoadedModel) -> tuple[bool, str]:
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

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.side = torch.cuda.Stream()

    def __call__(self, run: Callable[[], torch.Tensor],
                 restore: Callable[[], None]) -> Captured:
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


# torch.compile modes offered for the decode step. The autotuned one benchmarks matmul kernels
# for each shape while warming up: about a minute more per load (less once inductor's cache
# has them), 200 against 192 tok/s for one bf16 7B stream on the H200 (BENCHMARKS.md, run E).
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")


class GraphedBatchStep:
    """The batched decode step (runner.BatchRunner's step_fn) captured as one CUDA graph per view.

    Captured by hand: torch.compile's own "reduce-overhead" mode also replays CUDA graphs, but it
    first evaluates dynamo's guards and copies inputs on every call, which costs about as much
    as the GPU work of a 7B decode step. Here every input is already a persistent buffer of
    kv_cache.BatchKV (ids, positions, mask, cache views, the write index as a device tensor
    updated inside the graph): the graph reads them in place, so a replay needs no copies at
    all. One graph per (rows, slots) bucket of the view; a shape whose capture fails runs the
    plain forward uncaptured (logged): it never fails a reply.

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

    def __init__(self, model: PreTrainedModel, inductor_mode: str = "default",
                 compiled_rows: int = 1):
        self.model = model
        self.compiled = compile_forward(model, inductor_mode)
        self.compiled_rows = compiled_rows
        self._graphs: dict[tuple[int, int, int], Captured | None] = {}
        self.capture = GraphCapture()  # shared with the prefill graphs (runtime/preparation.py)
        self.failed: str | None = None
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)

    def __call__(self, kv: BatchKV, b: int, w: int) -> torch.Tensor:
        key = (id(kv), b, w)
        if key not in self._graphs:
            self._graphs[key] = self._capture_any(kv, b, w)
        entry = self._graphs[key]
        if entry is None:  # no graph for this shape: the plain forward, uncaptured
            return self.model(**kv.inputs(b, w)).logits[:, -1]
        graph, logits = entry
        graph.replay()
        return logits

    def _capture_any(self, kv: BatchKV, b: int, w: int) -> Captured | None:
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

    def _capture(self, kv: BatchKV, b: int, w: int,
                 forward: Callable[..., Any]) -> Captured:
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
