"""Fixtures for the CUDA tests: a small Qwen3 model trained for a few seconds on the GPU (peaked
distributions, see model_utils/bench/peaked_model.py) and engines loaded on it.

Run on a GPU machine with:  python -m pytest -m gpu tests/gpu -q
Without CUDA every test here is skipped with the reason.
"""

from __future__ import annotations

import gc

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
