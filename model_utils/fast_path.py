"""The fast path for single-stream decoding on a CUDA GPU: static KV cache + CUDA graphs.

Plain model.generate spends most of each token launching kernels from Python (a 7B model decodes
at 4-15 % of the H200's memory-bandwidth bound). Here the decode step has fixed shapes (one token,
a preallocated cache of a bucketed length), so torch.compile(mode="reduce-overhead") captures it
once as a CUDA graph and every later token is one graph replay.

It applies only where it can: one CUDA device holding every weight, a mode that compiles. Else the
eager path is used and the status says why.
"""

from __future__ import annotations

import logging
import time

import torch

from .decoders import CACHE_BUCKETS, StaticCaches, StaticDecoder

log = logging.getLogger(__name__)

# Modes whose bitsandbytes kernels break CUDA-graph capture (see BENCHMARKS.md for what was
# measured); they run on the eager path.
NOT_COMPILABLE_QUANT = {"int8"}


def support(loaded) -> tuple[bool, str]:
    """(applies, why) for a freshly loaded model."""
    devices = set(loaded.device_map)
    if not torch.cuda.is_available():
        return False, "eager path: no CUDA GPU (the compiled path needs CUDA graphs)"
    if len(devices) != 1 or not next(iter(devices)).startswith("cuda"):
        return False, (f"eager path: the weights are spread over {', '.join(sorted(devices))}; "
                       "the compiled path needs the whole model on one GPU")
    if loaded.mode.quantization in NOT_COMPILABLE_QUANT:
        return False, f"eager path: bitsandbytes {loaded.mode.name} does not compile to CUDA graphs"
    return True, "compiled path: static KV cache + CUDA graphs (torch.compile reduce-overhead)"


class FastPath:
    """Owns the compiled step and the static caches of one loaded model."""

    name = "static-cache+cuda-graphs"

    def __init__(self, model, *, fullgraph: bool = True):
        self.model = model
        self.caches = StaticCaches(model)
        # Each bucket is one more compiled shape; leave room for all of them.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit,
                                                    4 * len(CACHE_BUCKETS))
        self.step_fn = torch.compile(model.forward, mode="reduce-overhead",
                                     fullgraph=fullgraph, dynamic=False)

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


def attach(loaded, progress=None, *, warm_bucket: int = 1024) -> None:
    """Manager hook: decide the path for a new model and warm the fast one up."""
    applies, why = support(loaded)
    loaded.decode_path_reason = why
    if not applies:
        loaded.decode_path = "eager"
        return
    error = None
    # One whole graph is fastest; a model whose forward has a graph break still gains from
    # several captured pieces, so that is the second try before giving up on compiling.
    for fullgraph in (True, False):
        try:
            fast = FastPath(loaded.model, fullgraph=fullgraph)
            seconds = fast.warm_up(warm_bucket, progress)
            break
        except Exception as exc:  # noqa: BLE001 - any compile failure falls back, logged
            log.exception("compiling the decode step (fullgraph=%s) failed", fullgraph)
            error = exc
            torch._dynamo.reset()
    else:
        loaded.decode_path = "eager"
        loaded.decode_path_reason = f"eager path: compiling failed ({type(error).__name__}: " \
                                    f"{str(error).splitlines()[0][:200]})"
        return
    loaded.fast_path = fast
    loaded.decode_path = fast.name
    log.info("fast path ready for %s in %.1f s", loaded.display_name, seconds)
