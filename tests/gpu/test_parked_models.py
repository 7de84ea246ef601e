"""--park-gb on a GPU: the model a switch replaces leaves the card for page-locked host memory,
comes back on a switch back without the checkpoint being read, and answers as before."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from model_utils.loading.loaded_model import LoadRequest
from model_utils.runtime.generation_settings import GenerationSettings

from .conftest import CONTEXT, CUDA, gpu_marks, holders, load_engine

pytestmark = gpu_marks()
ASK = [{"role": "user", "content": "the quick brown fox"}]


def reply(engine) -> str:
    return engine.generate_text(ASK, GenerationSettings.greedy(max_new_tokens=16)).answer


def test_a_parked_model_leaves_the_gpu_and_comes_back_answering_the_same(peaked_gpu):
    engine = load_engine(peaked_gpu, "bf16", max_batch=4, park_gb=4)
    try:
        model = engine.manager.loaded.model
        first_reply = reply(engine)
        # While it serves, a page-locked buffer of its size is made for parking it.
        engine.manager.parked.wait()
        (reserved,) = engine.manager.parked._spares
        assert reserved.pinned and reserved.buffer.numel() >= sum(
            t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        made_ahead = reserved.buffer.data_ptr()
        engine.load(LoadRequest(str(peaked_gpu), "int8-wo", CUDA, context_tokens=CONTEXT))
        weights = next(model.parameters())
        assert weights.device.type == "cpu" and weights.is_pinned()
        # One registered buffer holds them all, not a pinned block per weight: the one made
        # ahead.
        parked = list(model.parameters())
        first = min(t.data_ptr() for t in parked)
        assert first == made_ahead
        last = max(t.data_ptr() + t.numel() * t.element_size() for t in parked)
        assert last - first <= sum(t.numel() * t.element_size() for t in parked) + 256 * len(parked)
        assert engine.manager.last_unload.leftover == {}, engine.manager.last_unload

        back = engine.load(LoadRequest(str(peaked_gpu), "bf16", CUDA, context_tokens=CONTEXT))
        assert engine.manager.loaded.model is model
        assert next(model.parameters()).device == torch.device("cuda", 0)
        assert back["last_switch"]["from_caches"][:1] == ["parked weights"]
        # Its compiled code was kept, and so was which one-row forward its first load timed.
        assert "timed at an earlier load" in engine.status()["decode_path_reason"]
        assert reply(engine) == first_reply
        # Every weight is back on the card, none left in the page-locked buffer. (The card's
        # allocated total cannot tell: this model's weights are a few MB, and with gemlite the
        # int8-wo load held 30 MB more besides its weights than this bf16 one, on an H100.)
        assert all(t.is_cuda for t in [*model.parameters(), *model.buffers()])

        # The buffer bf16 left stays as a spare, and the next switch parks bf16 into it.
        engine.load(LoadRequest(str(peaked_gpu), "int8-wo", CUDA, context_tokens=CONTEXT))
        assert min(t.data_ptr() for t in model.parameters()) == first
        assert next(model.parameters()).is_pinned()
        engine.load(LoadRequest(str(peaked_gpu), "bf16", CUDA, context_tokens=CONTEXT))
        assert reply(engine) == first_reply
    finally:
        engine.unload()


def test_an_unload_frees_the_models_parked_after_switches_back_and_forth(peaked_gpu, monkeypatch):
    """As in a tuned process (the app's): what is alive after each load is frozen out of the
    garbage collector's passes, and here no automatic pass runs, so only the engine's own
    collections free the models (on this path they are held in reference cycles)."""
    from model_utils import process_tuning

    monkeypatch.setattr(process_tuning, "_tuned", True)
    gc.disable()
    try:
        unload_after_switches(peaked_gpu)
    finally:
        gc.enable()
        gc.unfreeze()


def unload_after_switches(peaked_gpu):
    engine = load_engine(peaked_gpu, "bf16", max_batch=4, park_gb=4)
    bf16 = weakref.ref(engine.manager.loaded.model)
    spans = []  # the host buffers the parked weights lay in
    for mode in ("int8-wo", "bf16", "int8-wo"):
        before = engine.manager.loaded.model
        engine.load(LoadRequest(str(peaked_gpu), mode, CUDA, context_tokens=CONTEXT))
        parked = list(before.parameters())
        spans.append((min(t.data_ptr() for t in parked),
                      max(t.data_ptr() + t.numel() * t.element_size() for t in parked)))
        del before, parked
        reply(engine)
    int8 = weakref.ref(engine.manager.loaded.model)
    engine.unload()
    alive = {name: ref() for name, ref in (("bf16", bf16), ("int8-wo", int8)) if ref() is not None}
    assert not alive, {name: holders(model) for name, model in alive.items()}
    assert engine.manager.parked.gb == 0.0
    left = [t for t in gc.get_objects() if type(t) in (torch.Tensor, torch.nn.Parameter)
            and t.device.type == "cpu"
            and any(lo <= t.data_ptr() < hi for lo, hi in spans)]
    assert not left, [holders(t) for t in left[:2]]


@pytest.mark.parametrize("mode", ["nf4", "nf4-dq"])
def test_an_nf4_model_parks_with_its_quantization_state_and_answers_the_same(peaked_gpu, mode):
    pytest.importorskip("bitsandbytes")
    engine = load_engine(peaked_gpu, mode, max_batch=4, park_gb=4)
    try:
        model = engine.manager.loaded.model
        first_reply = reply(engine)
        engine.load(LoadRequest(str(peaked_gpu), "bf16", CUDA, context_tokens=CONTEXT))
        assert engine.manager.last_unload.leftover == {}, engine.manager.last_unload
        states = [p.quant_state for p in model.parameters() if type(p).__name__ == "Params4bit"]
        assert states and all(s.absmax.device.type == "cpu" and s.absmax.is_pinned()
                              for s in states)
        assert all(p.device.type == "cpu" for p in model.parameters())

        if mode == "nf4-dq":  # the nested state moved too
            assert all(s.state2.absmax.device.type == "cpu" and s.offset.device.type == "cpu"
                       for s in states)
        back = engine.load(LoadRequest(str(peaked_gpu), mode, CUDA, context_tokens=CONTEXT))
        assert engine.manager.loaded.model is model
        assert back["last_switch"]["from_caches"][:1] == ["parked weights"]
        assert all(s.absmax.device.type == "cuda" for s in states)
        assert reply(engine) == first_reply
    finally:
        engine.unload()
