"""Fixtures for the CUDA tests: a small Qwen3 model trained for a few seconds on the GPU (peaked
distributions, see model_utils/bench/peaked_model.py) and engines loaded on it.

Run on a GPU machine with:  python -m pytest -m gpu tests/gpu -q
Without CUDA every test here is skipped with the reason.
"""

from __future__ import annotations

import collections
import gc
import sys
import threading
import warnings

import pytest
import torch

from model_utils.engine import Engine
from model_utils.loading.loaded_model import LoadRequest
from model_utils.loading.placement import Placement

CUDA = Placement("cuda:0")
# Longer than the largest prefill graph bucket (1024) plus new tokens: the boundary tests cross it.
CONTEXT = 2304


def gpu_marks():
    return [pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="session")
def peaked_gpu(tmp_path_factory):
    from model_utils.bench.peaked_model import train

    folder = tmp_path_factory.mktemp("peaked-gpu") / "model"
    report = train(folder, hidden=256, layers=4, seconds=None, max_steps=300, window=128,
                   batch=32, device="cuda")
    assert report["loss_last"] < report["loss_first"] - 2, report
    return folder


def load_engine(folder, mode: str, *, context: int = CONTEXT, **engine_kwargs) -> Engine:
    engine = Engine(**engine_kwargs)
    engine.registry.allow_root(str(folder))
    engine.load(LoadRequest(str(folder), mode, CUDA, context_tokens=context))
    return engine


def plain(folder, mode: str):
    from model_utils.bench.per_mode import load_peer

    return load_peer(folder, mode)


@pytest.fixture(scope="session")
def fp32_graphed(peaked_gpu):
    engine = load_engine(peaked_gpu, "fp32", max_batch=8)
    assert "cuda-graphs" in engine.serving.decode_path, engine.status()
    yield engine
    engine.unload()


@pytest.fixture(scope="session")
def fp32_eager(peaked_gpu):
    engine = load_engine(peaked_gpu, "fp32", max_batch=8, compile=False)
    assert engine.serving.decode_path == "eager"
    yield engine
    engine.unload()


def holders(target, depth: int = 6) -> list[str]:
    """What keeps `target` alive: the chain of referrers (types, and names where modules)
    from it outwards, breadth first, frames and this test's own lists left out."""
    import types

    seen, chains, frontier = {id(target)}, [], [(target, type(target).__name__)]
    for _ in range(depth):
        nxt = []
        for obj, path in frontier:
            for ref in gc.get_referrers(obj):
                if id(ref) in seen or isinstance(ref, types.FrameType) or ref is frontier:
                    continue
                seen.add(id(ref))
                name = getattr(ref, "__qualname__", None) or getattr(ref, "__name__", None)
                step = f"{path} <- {type(ref).__name__}{f' {name}' if name else ''}"
                nxt.append((ref, step))
                chains.append(step)
        frontier = nxt[:40]
    return chains[-40:]


def path_from_modules(target, most: int = 5_000_000) -> str:
    """The shortest chain of references from an imported module (or a running thread's frame)
    down to `target`, e.g. "torch._dynamo.convert_frame .__dict__['cache'] -> dict[...] -> ...":
    what keeps an object alive when its direct referrers are anonymous lists and tuples.
    Breadth first over gc.get_referents; says so when nothing reachable holds it (a C/C++
    owner, or a cycle the collector has not freed)."""
    roots = [(module, f"module {name}") for name, module in list(sys.modules.items())
             if module is not None]
    roots += [(frame, f"thread {ident} in {frame.f_code.co_qualname}")
              for ident, frame in sys._current_frames().items()
              if ident != threading.get_ident()]  # this one's frames hold `target` itself
    parent: dict[int, tuple] = {}
    queue = collections.deque()
    for obj, label in roots:
        if id(obj) not in parent:
            parent[id(obj)] = (None, label, obj)
            queue.append(obj)
    with warnings.catch_warnings():  # isinstance on deprecated module attributes warns
        warnings.simplefilter("ignore")
        while queue and len(parent) < most:
            obj = queue.popleft()
            for child in gc.get_referents(obj):
                if id(child) in parent or isinstance(child, (str, bytes, int, float)):
                    continue
                parent[id(child)] = (obj, None, child)
                if child is target:
                    return _render_path(parent, child)
                queue.append(child)
    return f"not reachable from a module or thread (searched {len(parent)} objects)"


def _render_path(parent: dict, obj) -> str:
    steps = []
    while True:
        holder, label, _ = parent[id(obj)]
        if holder is None:
            steps.append(label)
            break
        steps.append(f"{_edge(holder, obj)} {type(obj).__qualname__}")
        obj = holder
    return " -> ".join(reversed(steps))


def _edge(holder, child) -> str:
    """How `holder` refers to `child`: a dict key, a sequence index, an instance's __dict__."""
    if isinstance(holder, dict):
        for key, value in holder.items():
            if value is child:
                return f"[{str(key)[:60]!r}]"
            if key is child:
                return "(a key)"
    if isinstance(holder, (list, tuple)):
        for index, value in enumerate(holder):
            if value is child:
                return f"[{index}]"
    if getattr(holder, "__dict__", None) is child:
        return ".__dict__"
    return f"({type(holder).__qualname__} holds)"


CONTAINERS = {"list", "dict", "tuple", "set", "frozenset", "cell", "function", "method",
              "FrameSummary", "StackSummary", "deque", "mappingproxy"}


def holder_chain(target, depth: int = 10) -> str:
    """One referrer chain up from `target`: the first referrer at each step, a dict named by
    the key it holds the step below under. Where an object that no module reaches hangs; a
    chain that ends at once is held from C++ alone. Plain loops: a comprehension's closure
    would be a referrer of its own."""
    import types

    steps, obj, skip = [type(target).__qualname__], target, {id(target)}
    for _ in range(depth):
        refs = []
        for ref in gc.get_referrers(obj):
            if id(ref) not in skip and not isinstance(ref, types.FrameType):
                refs.append(ref)
        skip.add(id(refs))
        if not refs:
            break
        owner, key = refs[0], None
        del refs
        if isinstance(owner, dict):
            for k, v in owner.items():
                if v is obj:
                    key = k
        steps.append(type(owner).__qualname__ + (f"[{key!r}]" if isinstance(key, str) else ""))
        skip.add(id(owner))
        obj = owner
    return " <- ".join(steps)


def owner_types(target, depth: int = 12, most: int = 20000) -> list[str]:
    """The classes of the first objects up the referrer chains of `target` that are not plain
    containers, nearest first: who owns an object that no module reaches (held from C++, say a
    ShapeEnv kept by its own SymNodes, or a guard manager's Python parts)."""
    import types

    seen, frontier, found = {id(target)}, [target], []
    for _ in range(depth):
        nxt = []
        for obj in frontier:
            for ref in gc.get_referrers(obj):
                if id(ref) in seen or isinstance(ref, types.FrameType) or ref is frontier:
                    continue
                seen.add(id(ref))
                name = type(ref).__qualname__
                if name in CONTAINERS:
                    nxt.append(ref)
                elif name not in found:
                    found.append(name)
        frontier = nxt[:most]
        if not frontier:
            break
    return found[:12]
