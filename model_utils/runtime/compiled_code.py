"""Forgetting what torch.compile built for a model that is unloaded.

torch._dynamo.reset() drops the compiled code and its caches, but not every guard: a compiled
function's guard manager registers a weakref.finalize on objects it guarded (the model classes,
the forward functions' code objects) so that it can invalidate itself when one of them dies.
Those objects live as long as the process, so the finalizers do too, and each holds its guard
manager with its guards and their stack summaries. Every load that compiled left a few thousand
such objects and about 14 MB of RSS on the 7B shape (BENCHMARKS.md, "Switching modes")."""

from __future__ import annotations

import functools
import weakref

import torch


def forget_compiled_code() -> int:
    """torch._dynamo.reset(), then detach the finalizers that still hold the discarded guard
    managers (after a reset every one of them belongs to code that will never run again).
    Returns how many were detached."""
    from torch._dynamo.guards import CheckFunctionManager

    torch._dynamo.reset()
    detached = 0
    for finalizer, info in list(weakref.finalize._registry.items()):  # noqa: SLF001 - no API
        callback = info.func.func if isinstance(info.func, functools.partial) else info.func
        if isinstance(getattr(callback, "__self__", None), CheckFunctionManager):
            finalizer.detach()
            detached += 1
    return detached
