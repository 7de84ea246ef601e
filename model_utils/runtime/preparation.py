"""Getting a loaded model ready to decode: the batched path, compiled and captured up front.

Called by the model manager right after the weights are in (Engine wires it as on_loaded): it
picks the decode path (CUDA graphs where they apply, else eager), builds the batch runner and
its scheduler, and on a GPU compiles and captures every shape serving needs before the first
reply, so that no user waits for a capture. Reads the engine's config (compile, compile mode,
compiled rows, max batch and queue).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from model_utils.layers.decode_fusions import fuse_for_decoding
from model_utils.layers.gated_delta import fuse_gated_delta
from model_utils.layers.gemlite_weights import save_tuned as keep_gemlite_tuning
from model_utils.loading.load_stages import Progress
from model_utils.loading.loaded_model import LoadedModel
from model_utils.memory import torch_cuda_gb

from . import compile_cache, compiled_code, cuda_graphs, kv_cache, paged_attention
from .runner import BatchRunner, EagerStep
from .scheduler import Scheduler
from .serving import Serving

if TYPE_CHECKING:
    from model_utils.engine_config import EngineConfig

    from .worker import DecodeWorker

log = logging.getLogger(__name__)

# The status's note while a deferred compile waits (--compile-while-idle).
COMPILING_LATER = "; one-reply step: the plain forward's graph until the compiled one is ready"


def _then(step, after):
    """`step`, then `after()` once it says it is done."""

    def run() -> bool:
        more = step()
        if not more:
            after()
        return more

    return run


class DecodePreparation:
    def __init__(self, config: EngineConfig, worker: DecodeWorker,
                 status_changed: Callable[[], None] = lambda: None):
        """`status_changed`: told when the status changes after the load (a step compiled
        while idle), so that open pages fetch it again."""
        self.config, self.worker, self.status_changed = config, worker, status_changed

    def __call__(self, loaded: LoadedModel, progress: Progress) -> Serving:
        serving = Serving(loaded)
        self._record_memory(serving, "weights")
        paged_attention.use_paged_attention(loaded.model)
        batches, why_not = kv_cache.support(loaded.model)
        if not batches:
            # Replies take turns on the single-stream eager decoder (decoders.EagerDecoder).
            log.warning("%s: replies are not batched (%s)", loaded.display_name, why_not)
            serving.decode_path_reason = f"eager path; replies take turns ({why_not})"
            return serving
        # Qwen3.5's linear-attention layers get their own forward on every batched path (it
        # keeps a prompt's states mid-forward, runner.forward_prompt). The other fusions only
        # where the step is compiled (below): the eager path keeps transformers' own forwards.
        fuse_gated_delta(loaded.model)
        step, path = EagerStep(loaded.model), "eager"
        applies, why = cuda_graphs.support(loaded)
        if not self.config.compile:
            why = "eager path: compilation turned off (--no-compile)"
        elif applies:
            fused = fuse_for_decoding(loaded.model)  # before compiling: it traces the fusions
            rows = self._compiled_rows()
            kind = compiled_code.model_kind(loaded.model, loaded.mode.name,
                                            f"{self.config.compile_mode}, {rows} rows")
            serving.compiled_code_kept = self.worker.call(
                lambda: compiled_code.reuse_or_make_room(kind))
            known = compiled_code.known_choices(kind) if serving.compiled_code_kept else {}
            step = cuda_graphs.GraphedBatchStep(
                loaded.model, self.config.compile_mode, compiled_rows=rows, known_choices=known,
                defer_compiling=self.config.compile_while_idle and not serving.compiled_code_kept)
            serving.model_kind = kind
            path = "paged-kv+cuda-graphs (batched)"
            why = "compiled path: batched paged KV cache + CUDA graphs" + \
                  "".join(f", {what}" for what in fused)
        serving.decode_path, serving.decode_path_reason = path, \
            f"{why}; up to {self.config.max_batch} concurrent replies decoded together"
        runner = BatchRunner(loaded.model, context_tokens=loaded.context_tokens,
                             max_batch=self.config.max_batch, step_fn=step)
        serving.scheduler = Scheduler(runner, post=self.worker.post,
                                      context_tokens=loaded.context_tokens,
                                      max_batch=self.config.max_batch,
                                      max_queue=self.config.max_queue, path_name=path)
        if path != "eager":
            self._warm_up(serving, progress)
        return serving

    def _warm_up(self, serving: Serving, progress: Progress) -> None:
        """Compile and capture the decode step now, for one reply and for every batch size up
        to max_batch, so that no user waits for it: a shape first met while serving stalls
        every reply decoding for as long as its capture takes (seconds for the larger shapes).
        With --compile-while-idle, a step not compiled in this process yet is compiled later,
        while no reply decodes (_compiled then notes what it gave)."""
        runner = serving.scheduler.runner
        step = runner.step_fn
        start, cached_before = time.perf_counter(), compile_cache.counts()
        graphs_before = compiled_code.graphs_compiled()
        progress(0.6, "capturing the decode step (one reply; compiled while idle)"
                 if self.config.compile_while_idle and not serving.compiled_code_kept
                 else "compiling the batched decode step (one reply)")
        self.worker.call(runner.warm_up)
        if step.failed:  # the one-row step did not capture: replies run uncaptured
            serving.decode_path = "eager"
            serving.decode_path_reason = f"eager path: compiling failed ({step.failed})"
            return
        if self.config.max_batch > 1:
            progress(0.9, f"capturing the decode step for 2-{self.config.max_batch} replies at "
                           "once")
            self.worker.call(lambda: runner.warm_up(range(2, self.config.max_batch + 1)))
            if step.failed:  # those shapes decode uncaptured
                log.warning("some batch sizes run uncaptured: %s", step.failed)
        self._record_memory(serving, "decode graphs")
        progress(0.95, "preparing the prefill of prompts")
        # The largest shape now (the pool's size), the others once the model is ready, while
        # no reply is decoding (_work_while_idle): each takes about a tenth of a second, twenty
        # of them most of a switch back to a mode used before. A prompt of a shape not
        # captured yet has it captured on the spot.
        self.worker.call(lambda: runner.use_padded_prefill(step.capture, largest_only=True))
        self.worker.call(runner.warm_up_tail)  # a next turn's new tokens
        padded = runner.padded_prefill
        if padded:
            note = (f"; prompts up to {padded.buckets[-1]} tokens prefilled by CUDA graphs, "
                    f"up to {max(rows for rows, _ in padded.shapes)} at once (the smaller "
                    "shapes captured while no reply decodes)")
            serving.decode_path_reason += note  # shapes that fail to capture: Serving.status
        self._record_memory(serving, "prefill graphs")

        def compiled() -> None:
            self._compiled(serving, start, cached_before, graphs_before)

        if step.compiles_pending():
            serving.decode_path_reason += COMPILING_LATER
            compile_step = _then(step.compile_next, compiled)
        else:
            compiled()
            compile_step = None
        # The warm-up's eager forwards left blocks in the allocator's cache: give them back,
        # so that the memory panels show what serving holds (graph pools stay reserved).
        torch.cuda.empty_cache()
        self._record_memory(serving, "ready")
        self._work_while_idle(serving, [padded.capture_next if padded else None, compile_step])

    def _compiled(self, serving: Serving, start: float, cached_before, graphs_before: int):
        """What compiling the step gave, in the status and the log: which one-row forward was
        kept, the compile cache's hits, whether the code of an earlier load served."""
        step = serving.scheduler.runner.step_fn
        if chosen := step.chosen.get(1):
            note = (f"; one-reply step: {chosen['kept']} forward kept" + (
                f" (compiling failed: {chosen['compiling_failed']})"
                if "compiling_failed" in chosen else
                f" (compiled {chosen['compiled_ms']} ms, plain {chosen['plain_ms']} ms a step"
                f"{', timed at an earlier load' if chosen.get('timed_before') else ''})"
                if "compiled_ms" in chosen else ""))
            reason = serving.decode_path_reason
            serving.decode_path_reason = reason.replace(COMPILING_LATER, note) \
                if COMPILING_LATER in reason else reason + note
        if serving.compiled_code_kept and compiled_code.graphs_compiled() > graphs_before:
            log.warning("the decode step of %s was compiled again though code of its kind was "
                        "kept; all kept code goes at the next load", serving.loaded.display_name)
            compiled_code.recompiled()
            serving.compiled_code_kept = False
        compiled_code.remember_choices(serving.model_kind, step.chosen)
        serving.compiled_graphs = {**compile_cache.since(cached_before),
                                   "kept": int(serving.compiled_code_kept)}
        keep_gemlite_tuning(serving.loaded.model)  # what the captures tuned, for the next load
        log.info("batched step ready for %s in %.1f s (compiled graphs: %d from the cache, %d "
                 "compiled afresh%s)", serving.loaded.display_name, time.perf_counter() - start,
                 serving.compiled_graphs["hits"], serving.compiled_graphs["misses"],
                 "; the code compiled for an earlier load of this kind reused"
                 if serving.compiled_code_kept else "")

    def _work_while_idle(self, serving: Serving, steps: list) -> None:
        """`steps` (each returns True while it has more to do; None: nothing) one after the
        other, a call a job on the worker while no reply decodes, until done or the model is
        unloaded (DecodeWorker.post_while_idle)."""
        steps = [s for s in steps if s is not None]
        if not steps:
            return

        def next_step() -> bool:
            if not steps:  # a second chain (resumed after a refused load) found it done
                return False
            try:
                more = steps[0]()
            except Exception:  # noqa: BLE001 - the next kind of work still gets its turn
                log.exception("work left for idle time failed")
                more = False
            if not more:
                steps.pop(0)
            if not steps:  # what serving holds now, the graphs captured while idle included
                torch.cuda.empty_cache()
                self._record_memory(serving, "ready")
                self.status_changed()
            return bool(steps)

        queue = serving.scheduler.queue

        def post() -> None:
            self.worker.post_while_idle(next_step, busy=lambda: any(queue.counts()),
                                        cancelled=serving.closed)

        serving.repost_idle_work = post
        post()

    def _compiled_rows(self) -> int:
        """The configured --compiled-rows, or by default every batch size: the plain forward's
        graph was slower than the compiled one's at every row count measured, for a model with
        linear-attention layers and for an attention-only one alike (BENCHMARKS.md, "Many
        streams")."""
        if self.config.compiled_rows is not None:
            return self.config.compiled_rows
        return self.config.max_batch

    @staticmethod
    def _record_memory(serving: Serving, stage: str) -> None:
        """Note CUDA memory after a step of the load (status, server.log): what the weights,
        the caches and the captured graphs each cost."""
        memory = torch_cuda_gb()
        if memory:
            serving.memory_stages[stage] = memory
            log.info("memory after %s: %s", stage,
                     ", ".join(f"{k} {v}" for k, v in memory.items()))

