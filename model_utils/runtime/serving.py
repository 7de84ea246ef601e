"""How one loaded model is served: what its preparation chose and built after the load.

The loaded model (loading.loaded_model.LoadedModel) is the weights, the tokenizer, the mode and
the device map; a `Serving` is the runtime's side of it: the decode path and why, the batch
scheduler over its runner (the KV cache, the CUDA graphs), the memory each step of getting
ready cost, and what the compile cache gave. The engine keeps the current one beside the
loaded model and drops it with that model's unload.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from model_utils.memory import GB

from . import compiled_code

if TYPE_CHECKING:
    from model_utils.loading.loaded_model import LoadedModel

    from .scheduler import Scheduler


@dataclass
class Serving:
    loaded: LoadedModel
    decode_path: str = "eager"
    decode_path_reason: str = ""
    scheduler: Scheduler | None = None  # when replies are batched; else they take turns
    # CUDA memory after each step of getting ready to decode (memory.torch_cuda_gb), in order
    memory_stages: dict[str, dict] = field(default_factory=dict)
    # Graphs the warm-up found in torch.compile's cache and compiled afresh (compile_cache)
    compiled_graphs: dict[str, int] = field(default_factory=dict)
    # The decode step's code was compiled in this process for an earlier load of the same kind
    # and found again (runtime/compiled_code.py): no tracing or compiling this time.
    compiled_code_kept: bool = False
    model_kind: str = ""  # compiled_code.model_kind, where the step is compiled
    # Set when the model is unloaded: work left for later (graphs captured while idle) stops.
    closed: threading.Event = field(default_factory=threading.Event)
    # Posts that work again (preparation sets it): a load that was refused had stopped it.
    repost_idle_work: Callable[[], None] | None = None

    def close(self) -> None:
        """At unload: the work left for idle time stops. A kind whose compiling was left for
        idle time and never done is not kept compiled (compiled_code)."""
        self.closed.set()
        step = self.scheduler.runner.step_fn if self.scheduler is not None else None
        if getattr(step, "compiles_pending", lambda: 0)():
            compiled_code.not_compiled(self.model_kind)

    def resume_idle_work(self) -> None:
        """The model serves on after a load was refused: the work left for idle time goes on."""
        if self.repost_idle_work is not None and self.idle_work_left():
            self.closed.clear()
            self.repost_idle_work()

    def idle_work_left(self) -> int:
        """Graphs the load left for the decode worker's idle time and not captured yet: prefill
        shapes, and steps whose compiling was deferred (--compile-while-idle)."""
        runner = self.scheduler.runner if self.scheduler is not None else None
        if runner is None:
            return 0
        padded = getattr(runner, "padded_prefill", None)
        compiles = getattr(runner.step_fn, "compiles_pending", lambda: 0)()
        return (len(padded.pending()) if padded else 0) + compiles

    def held_gb(self) -> dict[str, float]:
        """Per device, the memory serving holds beside the weights (the batch KV cache): a
        switch's fit counts it as free, since it goes with the model."""
        runner = self.scheduler.runner if self.scheduler is not None else None
        device = getattr(runner, "device", None)
        if device is None:
            return {}
        name = "cpu" if device.type == "cpu" else f"cuda:{device.index or 0}"
        return {name: runner.cache_bytes() / GB}

    def queue_status(self) -> dict | None:
        """{active, waiting, max_batch, max_queue} of the batch, or None when not batched."""
        return self.scheduler.load() if self.scheduler is not None else None

    def status(self) -> dict:
        """The decode path and what serving holds, as the status endpoint and the page show."""
        reason = self.decode_path_reason
        padded = getattr(self.scheduler.runner, "padded_prefill", None) if self.scheduler else None
        if padded is not None and (failed := tuple(padded.uncaptured)):  # captured at load or later
            shapes = ", ".join(f"{rows}x{tokens}" for rows, tokens in failed)
            reason += f" (prompts x tokens {shapes} failed to capture: eager)"
        status = {"decode_path": self.decode_path, "decode_path_reason": reason}
        if self.compiled_graphs:
            status["compiled_graphs"] = dict(self.compiled_graphs)
        if self.scheduler is not None:
            status["kv_cache_gb"] = round(self.scheduler.runner.cache_bytes() / GB, 4)
            if (blocks := self.scheduler.kv_blocks()) is not None:
                status["kv_blocks"] = blocks
        if self.memory_stages:
            status["memory_stages"] = dict(self.memory_stages)
        step = self.scheduler.runner.step_fn if self.scheduler is not None else None
        if (since := getattr(step, "compiling_since", None)) is not None:
            status["compiling_for_s"] = round(time.monotonic() - since, 1)
        return status
