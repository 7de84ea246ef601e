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
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from model_utils.layers.weight_only import inductor_options

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from model_utils.loading.loaded_model import LoadedModel

    from .kv_cache import PagedKV

# A captured graph and its output buffer, which each replay overwrites.
Captured = tuple[torch.cuda.CUDAGraph, torch.Tensor]

log = logging.getLogger(__name__)


def compile_forward(model: PreTrainedModel, inductor_mode: str,
                    dynamic: bool | None = False) -> Callable[..., Any]:
    """torch.compile of the model's forward, for one fixed shape (dynamic=False) or, with
    dynamic=None, torch's automatic dynamic shapes: the first shape is compiled as it is, and a
    second one that differs in the number of rows is compiled once more with that size symbolic,
    for every later one. A model with weight-only layers gets their inductor settings too
    (weight_only.inductor_options). torch.compile takes a mode or options, not both: a named mode
    is spelled out as its options then."""
    options = inductor_options(model)
    if options and inductor_mode != "default":
        from torch._inductor import list_mode_options

        options = {**list_mode_options(inductor_mode), **options}
    backend = _inductor_backend(None if options else inductor_mode, options, dynamic)
    return torch._dynamo.optimize(backend, nopython=True, dynamic=dynamic)(model.forward)


_backends: dict[str, Any] = {}  # inductor's backend per (mode, options, dynamic), made once
_backends_lock = threading.Lock()  # a load and an idle compile may ask at once


def _inductor_backend(mode: str | None, options: dict, dynamic: bool | None):
    """Inductor's backend as torch.compile(mode=..., options=...) makes it, one object per
    setting for the life of the process. Why not torch.compile itself: it makes a new backend
    object at every call, and dynamo keeps every backend it is given until torch._dynamo.reset()
    (eval_frame.cached_backends), so each load of a model added one to the process for good
    (found by tests/gpu/test_switch_memory.py counting live objects). torch's own advice for this
    (its BACKEND_MATCH message) is to reuse one backend; compiled code made with an equal one
    (the same settings) serves either."""
    key = repr((mode, sorted(options.items()), dynamic))
    with _backends_lock:
        if key not in _backends:
            _backends[key] = torch._TorchCompileInductorWrapper(mode, options or None, dynamic)
        return _backends[key]


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
    return True, "compiled path: paged KV cache + CUDA graphs"


class GraphCapture:
    """Captures CUDA graphs for one loaded model: one memory pool, one warm-up stream.

    One pool: a graph keeps the memory of its intermediate tensors in its pool, and graphs in
    separate pools each hold their own. The decode steps and the prompt prefills are replayed
    one at a time on the decode worker and exchange data only through persistent buffers (the
    caches, ids, positions, masks, each graph's output), which stay allocated, so they can share
    one pool: its size is the largest graph's intermediates, not their sum.

    One warm-up stream: each graph is first run on a side stream (compilation, autotuning, the
    allocator), and cuBLAS keeps a workspace for every stream it has run on until the workspaces
    are cleared (the engine does at unload): a new side stream per capture held a workspace more
    per graph, most of a GB over the graphs of a 32-row 7B model, measured on an H200.

    `warmups`: runs before each capture. Three as torch's own make_graphed_callables does, for
    a model whose code is new to the process (kernels compiled and autotuned at their first
    runs); one where the code compiled for an earlier load of the same kind is kept (its kernels
    are compiled and tuned already; the run makes cuBLAS's workspace and the allocator's
    blocks), which shortens a switch back by two runs of every shape captured.
    """

    def __init__(self, warmups: int = 3) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.side = torch.cuda.Stream()
        self.warmups = warmups

    def __call__(self, run: Callable[[], torch.Tensor],
                 restore: Callable[[], None]) -> Captured:
        """(graph, output) of `run` captured as one CUDA graph.

        Warm-up runs first; `restore` then puts back what they changed (the rows' positions)
        before the capture records the real step."""
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            for _ in range(self.warmups):
                run()
        torch.cuda.current_stream().wait_stream(self.side)
        restore()
        graph = torch.cuda.CUDAGraph()
        try:
            # "thread_local": the CUDA calls a capture cannot take (cudaMalloc among them) are
            # refused in this thread alone. Under torch's default, "global", another thread's
            # allocation fails while a graph is captured and breaks the capture too; idle
            # captures run on the decode worker while other threads may allocate (another
            # engine's load in the same process).
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                output = run()
        except Exception:
            _stop_recording_to(self.pool)
            raise
        return graph, output


def _stop_recording_to(pool: tuple[int, int]) -> None:
    """After a failed capture: torch's capture_end raised before it told the allocator to stop
    sending the capture's allocations to `pool`, and every later capture into the pool then
    failed ("beginAllocateToPool: already recording to mempool_id", seen with torch 2.11)."""
    try:
        torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool)
    except RuntimeError:
        pass  # the failed capture had ended it


class GraphedBatchStep:
    """The batched decode step (runner.BatchRunner's step_fn) captured as one CUDA graph per view.

    Captured by hand: torch.compile's own "reduce-overhead" mode also replays CUDA graphs, but it
    first evaluates dynamo's guards and copies inputs on every call, which costs about as much
    as the GPU work of a 7B decode step. Here every input is already a persistent buffer of
    kv_cache.PagedKV (ids, positions, block table; the write slots and lengths are derived from
    them inside the graph): the graph reads them in place, so a replay needs no copies at all.
    One graph per row bucket; a shape whose capture fails runs the plain forward uncaptured
    (logged): it never fails a reply.

    Which forward is captured: the torch.compile'd one for up to `compiled_rows` rows (the
    engine's default: every batch size, EngineConfig.compiled_rows), the model's plain forward
    for any other shape (see _capture_any). One row has a compilation of its own (fixed
    shapes); two rows and more share one with the number of rows symbolic (compile_forward's
    dynamic=None), so that compiling them all costs two compilations, not one per row bucket
    (a compilation per fixed size would add minutes to a load). A CUDA graph of the plain
    forward already removes the per-kernel launch cost, which is what made eager decoding slow;
    the compiled step's fused kernels make its graph faster still at every row count measured
    (BENCHMARKS.md, "Many streams"). Attention is the same paged decode kernel in both.
    """

    replays_graphs = True  # see BatchRunner.tail_rows

    def __init__(self, model: PreTrainedModel, inductor_mode: str = "default",
                 compiled_rows: int = 1, known_choices: dict[int, dict] | None = None,
                 defer_compiling: bool = False):
        """`known_choices`: `chosen` of an earlier load of the same kind of model (same class,
        configuration and mode, its compiled code kept): those shapes capture the forward kept
        then, without timing both again. `defer_compiling`: the shapes that would compile
        capture the plain forward for now, and compile_next() captures the compiled one and
        keeps the faster later (EngineConfig.compile_while_idle)."""
        self.model = model
        self.compiled = compile_forward(model, inductor_mode)
        self.compiled_batched = compile_forward(model, inductor_mode, dynamic=None) \
            if compiled_rows > 1 else self.compiled
        self.compiled_rows = compiled_rows
        self._graphs: dict[tuple[int, int], Captured | None] = {}
        # Shared with the prefill graphs (runtime/preparation.py); one warm-up run a capture
        # where an earlier load of this kind ran every kernel already (known_choices).
        self.capture = GraphCapture(warmups=1 if known_choices else 3)
        self.failed: str | None = None
        self.chosen: dict[int, dict] = {}  # rows -> which forward was kept, and both times
        self._known = known_choices or {}
        self._defer = defer_compiling
        self._deferred: list[tuple[PagedKV, int]] = []  # shapes whose compiling waits
        # When the compile under way began (time.monotonic), None when none is: a reply sent
        # meanwhile waits for it, and the chat page says why (Serving.status).
        self.compiling_since: float | None = None
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)

    def __call__(self, kv: PagedKV, b: int) -> torch.Tensor:
        key = (id(kv), b)
        if key not in self._graphs:
            self._graphs[key] = self._capture_any(kv, b)
        entry = self._graphs[key]
        if entry is None:  # no graph for this shape: the plain forward, uncaptured
            kv.prepare_decode(b)
            return self.model(**kv.decode_args(b)).logits[:, -1]
        graph, logits = entry
        graph.replay()
        return logits

    def _capture_any(self, kv: PagedKV, b: int) -> Captured | None:
        """The graph this shape replays, None when no forward captures (logged).

        Up to compiled_rows rows (every batch size by default), the compiled forward
        and the plain one are both captured and timed, and the faster is kept (`chosen` says
        which, with both times): compiling is expected to win, and a compiled step that loses
        (a kernel of a new torch or Triton, a mode that compiles badly) costs nothing but the
        timing. Any other shape captures the plain forward alone: a new compilation (tens of
        seconds) would stall every reply decoding. A shape timed at an earlier load of the
        same kind (known_choices) captures the forward kept then.
        """
        compiles = b <= self.compiled_rows and kv.may_compile
        known = self._known.get(b) if compiles else None
        deferred = compiles and self._defer and not known
        compiles = compiles and not deferred  # deferred: the plain forward until compile_next
        compiled = self.compiled if b == 1 else self.compiled_batched
        forwards = [compiled, self.model] if compiles else [self.model]
        if known:  # the forward an earlier load kept, alone; the other only if it fails
            first = compiled if known["kept"] == "compiled" else self.model
            forwards = [first] + [f for f in forwards if f is not first]
        captured = []
        reason = ""
        for forward in forwards:
            try:
                captured.append((forward, self._capture(kv, b, forward)))
            except Exception as error:  # noqa: BLE001 - serve eagerly rather than fail
                log.exception("capturing the batched step (%d rows) failed", b)
                reason = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
            if known and captured:
                if forward is forwards[0]:
                    self.chosen[b] = {**known, "timed_before": True}
                break
        if captured and deferred:
            self._deferred.append((kv, b))
        elif not captured and kv.may_compile and (deferred or b > self.compiled_rows):
            fallback = compiled if deferred else self.compiled_batched
            try:  # as a last resort, compiled now
                captured.append((fallback, self._capture(kv, b, fallback)))
            except Exception as error:  # noqa: BLE001
                log.exception("capturing the compiled batched step (%d rows) failed", b)
                reason = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        if not captured:
            self.failed = reason
            return None
        if len(captured) == 1:
            return captured[0][1]
        return self._faster(b, dict(captured))

    def _faster(self, b: int, captured: dict[Callable[..., Any], Captured]) -> Captured:
        """Of the plain forward's graph and the compiled one's, the one that replays faster
        (noted in `chosen`)."""
        times = {("plain" if forward is self.model else "compiled"): replay_ms(graph)
                 for forward, (graph, _) in captured.items()}
        kept = min(times, key=times.get)
        self.chosen[b] = {"kept": kept, **{f"{k}_ms": round(v, 3) for k, v in times.items()}}
        log.info("batched step for %d rows: compiled %.3f ms, plain forward %.3f ms a replay: "
                 "keeping the %s one", b, times["compiled"], times["plain"], kept)
        return next(entry for forward, entry in captured.items()
                    if (forward is not self.model) == (kept == "compiled"))

    def compiles_pending(self) -> int:
        """Shapes still decoding on the plain forward's graph until compile_next gets to them."""
        return len(self._deferred)

    def compile_next(self) -> bool:
        """Compile and capture the next deferred shape, and keep it where it replays faster
        than the plain forward's graph; True while more are deferred. On the worker thread,
        while no reply decodes: the warm-up runs write the cache's rows, all pointing at the
        null block then (as at load)."""
        if not self._deferred:
            return False
        kv, b = self._deferred[0]  # still counted as pending while it compiles
        compiled = self.compiled if b == 1 else self.compiled_batched
        plain = self._graphs.get((id(kv), b))
        self.compiling_since = time.monotonic()
        with torch.inference_mode():
            try:
                kv.pad_rows(0, b)
                kv.set_lengths(b, 1, b)
                captured = self._capture(kv, b, compiled)
                self._graphs[(id(kv), b)] = self._faster(b, {compiled: captured,
                                                             self.model: plain})
            except Exception as error:  # noqa: BLE001 - the plain forward's graph stays
                log.exception("compiling the batched step (%d rows) failed", b)
                self.chosen[b] = {"kept": "plain", "compiling_failed":
                                  f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
            finally:
                self.compiling_since = None
                self._deferred.pop(0)
                kv.pad_rows(0, kv.rows)
        return bool(self._deferred)

    def _capture(self, kv: PagedKV, b: int, forward: Callable[..., Any]) -> Captured:
        args = kv.decode_args(b)
        start = time.perf_counter()
        saved = kv.pos[:b].clone()

        def run():
            kv.prepare_decode(b)
            return forward(**args).logits[:, -1]

        def restore():  # the warm-up runs the step; put the rows' positions back
            kv.pos[:b].copy_(saved)

        graph, logits = self.capture(run, restore)
        log.info("captured the batched step (%s) for %d rows in %.1f s",
                 "plain forward" if forward is self.model else "compiled", b,
                 time.perf_counter() - start)
        return graph, logits


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int = 10) -> float:
    """Milliseconds one replay of a captured decode step takes (replaying it again is
    harmless: it writes the same keys and values to the same slots)."""
    for _ in range(2):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays
