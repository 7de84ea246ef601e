"""What torch.compile built, kept across mode switches within a process, and forgotten.

Kept: dynamo keeps compiled code on the code object of the model's forward, guarded by the
types, shapes and dtypes of what the forward reads (the parameters are inputs of the compiled
graph, not constants). A model loaded again with the same class, shapes and layer types, the
same mode of the same checkpoint for one, passes those guards: its decode step runs the code
compiled for the earlier load, with its own weights, and skips tracing and compiling (seconds
on the 7B shape even with every graph in the compile cache). The unloaded model is not kept
alive by it (tests/model_utils/test_compiled_code.py checks both).

Forgotten: each new kind of model adds compiled code, so past KEPT_KINDS kinds everything is
dropped at once (dynamo has no way to drop one kind's). torch._dynamo.reset() drops the
compiled code but not every guard: a compiled function's guard manager registers a
weakref.finalize on objects it guarded (the model classes, the forward functions' code objects)
so that it can invalidate itself when one of them dies; those objects live as long as the
process, so the finalizers and their guard managers, with every guard and its stack summary,
did too: a few thousand objects and about 14 MB of RSS a load on the 7B shape
(BENCHMARKS.md, "Switching modes"). forget_compiled_code detaches them."""

from __future__ import annotations

import functools
import hashlib
import threading
import weakref

import torch

# How many kinds of model (class, mode, configuration) keep their compiled code in a process:
# a switch among the last few modes finds its code; more would only grow the process.
KEPT_KINDS = 4

_kept: list[str] = []  # kinds whose code dynamo holds now, the most recently used last
_lock = threading.Lock()


def model_kind(model: torch.nn.Module, mode: str, compile_settings: str) -> str:
    """What decides whether code compiled for one load can serve another: the model's class,
    its configuration, the mode and how the step is compiled."""
    config = getattr(model, "config", None)
    text = config.to_json_string(use_diff=False) if config is not None else ""
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return f"{type(model).__qualname__}/{mode}/{compile_settings}/{digest}"


def reuse_or_make_room(kind: str) -> bool:
    """Before compiling a model's step: True when code compiled in this process for this kind
    is still held (the step will find it), False when it is compiled anew; past KEPT_KINDS
    kinds, everything compiled before is forgotten first."""
    with _lock:
        if kind in _kept:
            _kept.remove(kind)
            _kept.append(kind)
            return True
        if len(_kept) >= KEPT_KINDS:
            forget_compiled_code()
        _kept.append(kind)
        return False


def forget_compiled_code() -> int:
    """torch._dynamo.reset(), then detach the finalizers that still hold the discarded guard
    managers (after a reset every one of them belongs to code that will never run again).
    Returns how many were detached."""
    from torch._dynamo.guards import CheckFunctionManager

    torch._dynamo.reset()
    _kept.clear()
    detached = 0
    for finalizer, info in list(weakref.finalize._registry.items()):  # noqa: SLF001 - no API
        callback = info.func.func if isinstance(info.func, functools.partial) else info.func
        if isinstance(getattr(callback, "__self__", None), CheckFunctionManager):
            finalizer.detach()
            detached += 1
    return detached
