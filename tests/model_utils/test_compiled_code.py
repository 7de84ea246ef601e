"""An unload forgets what torch.compile built: after forget_compiled_code no guard manager of
the compiled forward is left alive, however many times a model was compiled and dropped
(torch._dynamo.reset() alone left each one held by finalizers on the model's classes)."""

from __future__ import annotations

import gc

import torch
from transformers import AutoModelForCausalLM

from model_utils.loading.demo_model import demo_model_path
from model_utils.runtime.compiled_code import forget_compiled_code


def guard_managers() -> int:
    from torch._dynamo.guards import CheckFunctionManager

    gc.collect()
    return sum(isinstance(o, CheckFunctionManager) for o in gc.get_objects())


def compile_and_run_once() -> None:
    model = AutoModelForCausalLM.from_pretrained(demo_model_path(), dtype=torch.float32)
    # aot_eager: dynamo's tracing and guards as on a GPU, no C++ compiler needed here
    forward = torch.compile(model.forward, fullgraph=True, dynamic=False, backend="aot_eager")
    with torch.inference_mode():
        forward(input_ids=torch.tensor([[1, 2, 3, 4]]), use_cache=False)
    assert guard_managers() >= 1  # the compiled forward is guarded


def test_no_guard_manager_outlives_the_unloads():
    before = guard_managers()
    for _ in range(2):
        compile_and_run_once()
        assert forget_compiled_code() >= 1
        assert guard_managers() == before
