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
(BENCHMARKS.md, "Switching modes"). forget_compiled_code detaches them. A step compiled for
a symbolic row count (the batched step from 2 rows) also left its tracing state behind at each
forget, a ShapeEnv with its fake weights and the guards' stack summaries (RSS that grew with
every cycle of five compiled modes on a GPU): the ShapeEnv's tracked fakes hold its symbols from C++,
a cycle the garbage collector cannot see, and its class's method caches hold the ShapeEnv.
forget_compiled_code breaks both (_release_shape_envs;
benchmarks/cpu-2026-12-06/compile_forget_growth.py with "dyn" shows the growth and its end).
Inductor's registry of the code modules it loaded (PyCodeCache.modules) appends one for every
graph compiled or read back from its cache, and drops none: with a module's kernels (a GPU
one's loaded on the device) it outlived every forget. forget_compiled_code empties it.
And on torch 2.11 every compile's "diff guard" copy of its guard tree (dynamo builds one at
each compile and recompile, read only under the skip_guard_eval_unsafe stance, which the app
never takes) is a C++ object nothing frees: it kept guards of every forgotten compile, with
their stacks and code strings, for the life of the process. Compiles here build none
(_build_no_diff_guards)."""

from __future__ import annotations

import functools
import gc
import hashlib
import threading
import weakref

import torch

# How many kinds of model (class, mode, configuration) keep their compiled code in a process:
# a switch among the last few modes finds its code; more would only grow the process. Eight
# hold every GPU mode of one model a user cycles through: with four, a cycle through five
# compiled modes compiled anew at every load (seconds a switch, BENCHMARKS.md "Switching
# modes").
KEPT_KINDS = 8

_kept: list[str] = []  # kinds whose code dynamo holds now, the most recently used last
# Per kept kind, which forward each compiled shape's graph kept (cuda_graphs.GraphedBatchStep's
# `chosen`): a later load of the kind captures that one alone instead of timing both again.
_choices: dict[str, dict[int, dict]] = {}
_forget_at_next_load = False  # a kind thought kept compiled again (see recompiled)
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
    global _forget_at_next_load
    _build_no_diff_guards()
    with _lock:
        if _forget_at_next_load or (kind not in _kept and len(_kept) >= KEPT_KINDS):
            forget_compiled_code()
            _forget_at_next_load = False
        if kind in _kept:
            _kept.remove(kind)
            _kept.append(kind)
            return True
        # Dynamo's record of the shapes each frame has seen decides which dimensions it
        # compiles as symbols: a new kind starts from none, as after a reset, rather than
        # from the sizes of another model of the same class.
        from torch._dynamo.pgo import reset_code_state

        reset_code_state()
        _kept.append(kind)
        return False


def known_choices(kind: str) -> dict[int, dict]:
    with _lock:
        return dict(_choices.get(kind, {})) if kind in _kept else {}


def remember_choices(kind: str, chosen: dict[int, dict]) -> None:
    with _lock:
        if kind in _kept and chosen:
            _choices[kind] = {rows: {k: v for k, v in record.items() if k != "timed_before"}
                              for rows, record in chosen.items()}


def not_compiled(kind: str) -> None:
    """A load of `kind` whose compiling was left for later ended before it (unloaded): the
    kind is not kept, so that its next load compiles as a new kind would."""
    with _lock:
        if kind in _kept:
            _kept.remove(kind)
        _choices.pop(kind, None)


def graphs_compiled() -> int:
    """How many graphs dynamo has compiled in this process (to tell a kept kind's load that
    compiled nothing from one that did)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def recompiled() -> None:
    """The step of a kind thought kept was compiled again (its code did not serve: another
    engine's cache holds the ids it was compiled with, a layer changed): everything is
    forgotten at the next load, so that entries cannot pile up on the forward's code."""
    global _forget_at_next_load
    with _lock:
        _forget_at_next_load = True


def forget_compiled_code() -> int:
    """torch._dynamo.reset(), then detach the finalizers that still hold the discarded guard
    managers (after a reset every one of them belongs to code that will never run again),
    release the tracing states of dynamic-shape compiles and empty inductor's registry of
    loaded code modules. Returns how many finalizers were detached."""
    from torch._dynamo.convert_frame import compile_lock
    from torch._dynamo.guards import CheckFunctionManager

    with compile_lock:  # an RLock (reset takes it too): no frame is traced meanwhile
        torch._dynamo.reset()
        _kept.clear()
        _choices.clear()
        gc.disable()  # a collection now could run a finalizer and change the registry mid-copy
        try:
            registry = list(weakref.finalize._registry.items())  # noqa: SLF001 - no API for it
        finally:
            gc.enable()
        detached = 0
        for finalizer, info in registry:
            callback = info.func.func if isinstance(info.func, functools.partial) else info.func
            if isinstance(getattr(callback, "__self__", None), CheckFunctionManager):
                finalizer.detach()
                detached += 1
        _release_shape_envs()
        _release_code_modules()
    return detached


def _release_shape_envs() -> None:
    """Let the tracing state of code compiled with dynamic shapes go (a ShapeEnv, its
    FakeTensorMode and fake inputs and weights). A ShapeEnv's tracked_fakes hold fake tensors
    whose sizes are its own symbols: the C++ SymInts of a fake (s0, 1) tensor hold their
    SymNode, which holds the ShapeEnv, a cycle through C++ that gc cannot see, so it outlived
    the reset. tracked_fakes serve only a compile's guards (none runs: the caller holds the
    compile lock). ShapeEnv's method lru_caches, keyed by the ShapeEnv, hold recent ones too."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # The fake-tensor dispatch cache is class-wide: its keys hold the symbolic sizes of
    # every compile since the process began (reset() leaves it).
    FakeTensorMode.cache_clear()
    for shape_env in [o for o in gc.get_objects() if type(o) is ShapeEnv]:
        if shape_env.tracked_fakes:
            shape_env.tracked_fakes.clear()
    for attribute in vars(ShapeEnv).values():
        clear = getattr(attribute, "cache_clear", None)
        if callable(clear):
            clear()


def _release_code_modules() -> None:
    """Inductor's record of every code module it loaded, kept for its own debugging tools,
    and their entries in sys.modules (the compiled code that runs holds its module itself):
    after a reset they hold only the modules of code that will never run again, with their
    kernels."""
    import sys

    from torch._inductor.codecache import PyCodeCache

    for module in [*PyCodeCache.modules, *PyCodeCache.modules_no_attr.values()]:
        if sys.modules.get(module.__name__) is module:
            del sys.modules[module.__name__]
    PyCodeCache.cache_clear()


@functools.cache
def _build_no_diff_guards() -> None:
    """Dynamo's guard wrapper builds, at every compile and recompile, a copy of its guard tree
    that holds only the guards that failed so far (its "diff guard root"), which only the
    skip_guard_eval_unsafe stance runs. torch 2.11's copy is a C++ root that nothing frees,
    holding the guards it shares with the tree it was copied from: every forgotten compile's
    global-state and input guards stayed, each with the stack it was made at. Without the copy
    the stance would find no guards to run (as for a wrapper torch deleted itself); the app
    never takes it."""
    from torch._dynamo.guards import GuardManagerWrapper

    def no_diff_guard_root(wrapper) -> None:
        wrapper.diff_guard_root = None

    if hasattr(GuardManagerWrapper, "populate_diff_guard_manager"):
        GuardManagerWrapper.populate_diff_guard_manager = no_diff_guard_root
