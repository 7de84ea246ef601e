"""What a loaded model holds and what an unload gives back: the memory counters an unload is
judged by, the bytes a weight really stores (quantization statistics included), the device map
as layers and GB per device, and the process-level steps that make freed memory show."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import time
import weakref

import psutil
import torch

from model_utils.memory import GB

# Below this an unload counts as complete (the CUDA counters' rounding). Process RSS is not
# judged: it grows by tens of MB with the imports and caches of a first load alone.
LEFTOVER_FLOOR_GB = 0.001
log = logging.getLogger("model_utils.loading.manager")  # the unload's lines, with the load's


def leftover_after(baseline: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What an unload left held, per device counter: over the memory in use before the load,
    never negative (a counter below its baseline held nothing of the model)."""
    held = {k: after[k] - baseline.get(k, 0.0) for k in after if k != "rss_gb"}
    return {k: round(v, 4) for k, v in held.items() if v > LEFTOVER_FLOOR_GB}


def largest_live_tensors(device_type: str, *, top: int = 5) -> list[str]:
    """The largest tensors on devices of this type that something still references, as
    'bfloat16 [152064, 3584] 1.016 GB on cuda:0': what an unload's leftover is made of, where
    the garbage collector can see it (a graph pool or a library's C++ buffer it cannot)."""
    from torch._subclasses.fake_tensor import FakeTensor

    found: dict[int, torch.Tensor] = {}  # one per storage: views name the tensor they cut
    for obj in gc.get_objects():
        # type(obj), not isinstance: an object's own __class__ may warn (torch.distributed's
        # deprecated reduce_op). A fake tensor (torch.compile's tracing) holds no memory.
        kind = type(obj)
        if not issubclass(kind, torch.Tensor) or issubclass(kind, FakeTensor):
            continue
        with contextlib.suppress(Exception):  # a tensor subclass may refuse these
            if obj.device.type == device_type:
                key = obj.untyped_storage().data_ptr()
                if key not in found or obj.numel() > found[key].numel():
                    found[key] = obj
    largest = sorted(found.values(), key=lambda t: -t.untyped_storage().nbytes())[:top]
    return [f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)} "
            f"{t.untyped_storage().nbytes() / GB:.3f} GB on {t.device}" for t in largest]


def model_referrers(obj: object, *, depth: int = 4, top: int = 5) -> list[str]:
    """Who keeps `obj` alive, in words, each as a chain down to it: 'loaded, a local variable
    of run (bench.py:12) -> a LoadedModel -> it'. An object alive after its unload is most
    often kept by a caller's local variable, which this names. Looks `depth` referrers up
    (the garbage collector's view), then for any of them in the local variables of every
    thread's running functions (which that view does not show); without such a root, the
    objects found furthest up."""
    import sys
    import types

    containers = (dict, list, tuple, set, types.CellType, types.FunctionType)
    seen, chain = {id(obj): obj}, {id(obj): "it"}  # what was looked at (and held here)
    level = [obj]
    for _ in range(depth):
        above: list = []
        for target in level:
            for ref in gc.get_referrers(target):
                if (id(ref) in seen or ref is level or ref is above or ref is seen
                        or isinstance(ref, types.FrameType)):
                    continue
                name = chain[id(target)]
                seen[id(ref)] = ref
                chain[id(ref)] = name if isinstance(ref, containers) \
                    else f"a {type(ref).__name__} -> {name}"
                above.append(ref)
        level = above
    found = []
    for frame in sys._current_frames().values():
        while frame is not None and len(found) < top:
            if frame.f_globals is not globals():  # not this module's frames, which ask
                found += _locals_among(frame, seen, chain)
            frame = frame.f_back
    return found[:top] or [chain[id(o)] for o in level[:top]]


def _locals_among(frame, seen: dict, chain: dict) -> list[str]:
    """The local variables of `frame` that are among `seen`, in words."""
    import sys

    names = frame.f_locals
    found = [f"{name}, a local variable of {frame.f_code.co_name} "
             f"({frame.f_code.co_filename}:{frame.f_lineno}) -> {chain[id(value)]}"
             for name, value in names.items() if id(value) in seen and seen[id(value)] is value]
    # Before Python 3.13 a function's f_locals is a snapshot the frame keeps until it returns,
    # which would keep what it found alive after the caller lets go; emptied, it is rebuilt
    # from the frame's variables on the next read. (A module's or class body's f_locals is its
    # namespace itself, left alone.)
    if sys.version_info < (3, 13) and frame.f_code.co_flags & 0x1:  # CO_OPTIMIZED
        names.clear()
    return found


def drop_error_frames(error: BaseException) -> None:
    """Let a caught load error stop keeping the model it failed on. An exception's traceback
    keeps every frame it passed through, and with them their local variables: the half-loaded
    model of _load_locked, peft's wrapper of it. Whoever holds the error (the restore that
    runs inside its except block, a caller showing its message) would keep the whole model,
    on the GPU beside the one being restored. Clearing the finished frames keeps the
    traceback's text (files, lines) and drops their variables, along the whole chain of
    causes and contexts (`raise ... from None` still keeps its context)."""
    import traceback

    seen: set[int] = set()
    errors = [error]
    while errors:
        error = errors.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)  # a frame still running is left as it is
        errors += [error.__cause__, error.__context__]


def unload_report(name: str, baseline: dict[str, float], before: dict[str, float],
                  model: weakref.ref | None = None, *, parked_gb: float = 0.0):
    """Release what the unloaded model left to the garbage collector and the caches, then say
    what came back (an UnloadReport, also logged): `baseline` is memory_counters() before the
    load, `before` just before the unload, `model` a weak reference to the unloaded model,
    to say who still keeps it when anyone does (None for a model parked on purpose, whose
    `parked_gb` stay in host memory)."""
    from .loaded_model import UnloadReport

    start = time.perf_counter()
    _release_freed_memory()
    released_s = time.perf_counter() - start
    after = memory_counters()
    leftover = leftover_after(baseline, after)
    freed = {k: round(max(0.0, before[k] - after.get(k, 0.0)), 4) for k in before}
    # Only live tensors can explain allocated memory; reserved memory alone is the caching
    # allocator's (a few MB a library keeps), and the search walks every object the process
    # tracks, on the switch's own time.
    held_by = largest_live_tensors("cuda") \
        if any(k.startswith("cuda") and k.endswith("_allocated_gb") for k in leftover) else []
    still = model() if model is not None else None
    kept_by = model_referrers(still) if still is not None else []
    del still
    log.info("unloaded %s; memory before %s after %s (the garbage collector and the caches "
             "took %.2f s)", name, _fmt(before), _fmt(after), released_s)
    if leftover:
        log.warning("after unloading %s, memory still held: %s%s", name, _fmt(leftover),
                    f" (largest tensors still referenced: {'; '.join(held_by)})"
                    if held_by else "")
    if kept_by:
        log.warning("after unloading %s, the model object is still alive, kept by: %s", name,
                    "; ".join(kept_by))
    return UnloadReport(name, before, after, leftover, freed, held_by, kept_by, parked_gb)


def _fmt(counters: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.3f}" for k, v in counters.items())


def memory_counters() -> dict[str, float]:
    counters = {"rss_gb": psutil.Process().memory_info().rss / GB}
    for i in range(torch.cuda.device_count()):
        counters[f"cuda:{i}_allocated_gb"] = torch.cuda.memory_allocated(i) / GB
        counters[f"cuda:{i}_reserved_gb"] = torch.cuda.memory_reserved(i) / GB
    return counters


def _release_freed_memory() -> None:
    gc.unfreeze()  # see freeze_long_lived: what was frozen with the old model may be garbage now
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    # glibc keeps freed heap pages mapped; malloc_trim hands them back to the OS so that
    # process RSS (what the memory panel shows) really drops after an unload.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def freeze_long_lived() -> None:
    """Exempt everything alive after a load (the model, its tokenizer, the web server) from the
    garbage collector's full passes. With a model loaded the process tracks ~500 000 objects and
    one full pass over them took 205 ms (demo model, a 2-core CPU machine): a pause of every
    thread, the decode loop's included, whenever enough new objects have survived. After
    gc.freeze() a full pass only scans what came later (measured: under 1 ms). Called after each
    load, and by app.py once the web server is up. An unload unfreezes first, so that the old
    model's reference cycles are collected."""
    gc.collect()
    gc.freeze()


# glibc serves big allocations from their own mappings, returned to the OS on free, but it
# raises that size threshold each time such a block is freed (up to 32 MB), after which freed
# weights stay in the heap and RSS never drops (measured: ~95 MB of a 125 MB model still counted
# after its unload). Pinned at 256 KB, every weight matrix lives in its own mapping and an unload
# shows up in RSS; small tensors keep the heap. The price is a page-fault cost on large
# activations, which only matters on the (already slow) CPU path.
MMAP_THRESHOLD_BYTES = 256 * 2**10


def pin_mmap_threshold() -> None:
    m_mmap_threshold = -3  # mallopt parameter number, from glibc's malloc.h
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, MMAP_THRESHOLD_BYTES)


def stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes a weight holds in memory, bitsandbytes' quantization statistics included: the
    absmax of every 64-value block of a 4-bit weight (0.4 GB for a 7B model in nf4, which
    model.get_memory_footprint() leaves out) and the row scales of an int8 one."""
    total = tensor.numel() * tensor.element_size()
    state = getattr(tensor, "quant_state", None)
    while state is not None:
        for part in (state.absmax, state.code, state.offset):
            if isinstance(part, torch.Tensor):
                total += part.numel() * part.element_size()
        state = state.state2
    scales = getattr(tensor, "SCB", None)
    if isinstance(scales, torch.Tensor):
        total += scales.numel() * scales.element_size()
    return total


def summarize_device_map(model: torch.nn.Module) -> dict[str, dict]:
    """Per device: which decoder layers live there and how many GB of weights."""
    per_device: dict[str, dict] = {}
    hf_map = getattr(model, "hf_device_map", None) or {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        device = str(tensor.device)
        if device == "meta":  # offloaded: accelerate's map knows where it really lives
            owner = max((k for k in hf_map if name.startswith(k)), key=len, default="")
            device = str(hf_map.get(owner, "disk"))
        elif device.isdigit():
            device = f"cuda:{device}"
        entry = per_device.setdefault(device, {"layers": set(), "gb": 0.0})
        entry["gb"] += stored_bytes(tensor) / GB
        parts = name.split(".")
        if "layers" in parts and parts.index("layers") + 1 < len(parts):
            index = parts[parts.index("layers") + 1]
            if index.isdigit():
                entry["layers"].add(int(index))
    return {d: {"layers": _ranges(e["layers"]), "gb": round(e["gb"], 4)}
            for d, e in per_device.items()}


def _ranges(indices: set[int]) -> str:
    """{0,1,2,5,6} -> "0-2, 5-6"."""
    out, run = [], []
    for i in sorted(indices):
        if run and i != run[-1] + 1:
            out.append(run)
            run = []
        run.append(i)
    if run:
        out.append(run)
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in out) or "-"
