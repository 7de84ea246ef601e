"""--park-gb on a GPU: the model a switch replaces leaves the card for page-locked host memory,
comes back on a switch back without the checkpoint being read, and answers as before."""

from __future__ import annotations

import torch

from model_utils.loading.loaded_model import LoadRequest
from model_utils.runtime.generation_settings import GenerationSettings

from .conftest import CONTEXT, CUDA, gpu_marks, load_engine

pytestmark = gpu_marks()
ASK = [{"role": "user", "content": "the quick brown fox"}]


def reply(engine) -> str:
    return engine.generate_text(ASK, GenerationSettings.greedy(max_new_tokens=16)).answer


def test_a_parked_model_leaves_the_gpu_and_comes_back_answering_the_same(peaked_gpu):
    engine = load_engine(peaked_gpu, "bf16", max_batch=4, park_gb=4)
    try:
        model = engine.manager.loaded.model
        first_reply = reply(engine)
        engine.load(LoadRequest(str(peaked_gpu), "int8-wo", CUDA, context_tokens=CONTEXT))
        weights = next(model.parameters())
        assert weights.device.type == "cpu" and weights.is_pinned()
        # One registered buffer holds them all, not a pinned block per weight.
        parked = list(model.parameters())
        first = min(t.data_ptr() for t in parked)
        last = max(t.data_ptr() + t.numel() * t.element_size() for t in parked)
        assert last - first <= sum(t.numel() * t.element_size() for t in parked) + 256 * len(parked)
        int8_only = torch.cuda.memory_allocated(0)
        assert engine.manager.last_unload.leftover == {}, engine.manager.last_unload

        back = engine.load(LoadRequest(str(peaked_gpu), "bf16", CUDA, context_tokens=CONTEXT))
        assert engine.manager.loaded.model is model
        assert next(model.parameters()).device == torch.device("cuda", 0)
        assert back["last_switch"]["from_caches"][:1] == ["parked weights"]
        # Its compiled code was kept, and so was which one-row forward its first load timed.
        assert "timed at an earlier load" in engine.status()["decode_path_reason"]
        assert reply(engine) == first_reply
        assert torch.cuda.memory_allocated(0) > int8_only  # bf16's weights are back on the card

        # The buffer bf16 left stays as a spare, and the next switch parks bf16 into it.
        engine.load(LoadRequest(str(peaked_gpu), "int8-wo", CUDA, context_tokens=CONTEXT))
        assert min(t.data_ptr() for t in model.parameters()) == first
        assert next(model.parameters()).is_pinned()
        engine.load(LoadRequest(str(peaked_gpu), "bf16", CUDA, context_tokens=CONTEXT))
        assert reply(engine) == first_reply
    finally:
        engine.unload()
