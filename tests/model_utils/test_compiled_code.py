"""What torch.compile built, kept across loads and forgotten (runtime/compiled_code.py): a model
of the same kind loaded again runs the code compiled for the one before with its own weights,
and neither the kept code nor a forget keeps an unloaded model or a guard manager alive.

The compiled forward is the demo model's through aot_eager: dynamo's tracing, guards and cache
as on a GPU, without a C++ compiler."""

from __future__ import annotations

import gc
import traceback
import types
import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM

from model_utils.loading.demo_model import demo_model_path
from model_utils.runtime import compiled_code

IDS = torch.tensor([[1, 2, 3, 4, 5]])


def guard_managers() -> int:
    from torch._dynamo.guards import CheckFunctionManager

    gc.collect()
    # type(o), not isinstance: some objects' own __class__ warns (torch.distributed.reduce_op)
    return sum(issubclass(type(o), CheckFunctionManager) for o in gc.get_objects())


def load(seed: int) -> torch.nn.Module:
    """The demo model with its weights moved by a seed: each load its own numbers."""
    model = AutoModelForCausalLM.from_pretrained(demo_model_path(), dtype=torch.float32)
    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return model


def compiled_first_call(model) -> tuple[torch.Tensor, int]:
    """The compiled forward's logits, and how many graphs dynamo compiled for the call."""
    from torch._dynamo.utils import counters

    forward = torch.compile(model.forward, fullgraph=True, dynamic=False, backend="aot_eager")
    before = counters["stats"]["unique_graphs"]
    with torch.inference_mode():
        logits = forward(input_ids=IDS, use_cache=False).logits
    return logits, counters["stats"]["unique_graphs"] - before


@pytest.fixture
def fresh():
    compiled_code.forget_compiled_code()
    yield
    compiled_code.forget_compiled_code()


def test_a_load_of_the_same_kind_runs_the_kept_code_with_its_own_weights(fresh):
    first = load(1)
    kind = compiled_code.model_kind(first, "fp32", "aot_eager")
    assert compiled_code.reuse_or_make_room(kind) is False  # nothing compiled yet
    _, compiled = compiled_first_call(first)
    assert compiled == 1
    held = weakref.ref(first.model.embed_tokens.weight)
    del first
    gc.collect()  # as an unload does: the model's own reference cycles

    second = load(2)
    assert compiled_code.model_kind(second, "fp32", "aot_eager") == kind
    assert compiled_code.reuse_or_make_room(kind) is True
    assert held() is None  # the kept code does not keep the unloaded model
    logits, compiled = compiled_first_call(second)
    assert compiled == 0  # no tracing: the code compiled for the first load ran
    with torch.inference_mode():
        assert torch.equal(logits, second(input_ids=IDS, use_cache=False).logits)


def test_past_the_kept_kinds_everything_compiled_is_forgotten(fresh):
    before = guard_managers()
    for i in range(compiled_code.KEPT_KINDS):
        assert compiled_code.reuse_or_make_room(f"kind {i}") is False
    compiled_first_call(load(0))  # the code of the last kind made room for
    assert compiled_code.reuse_or_make_room("kind 0") is True  # now the most recent
    assert guard_managers() > before
    assert compiled_code.reuse_or_make_room("one kind more") is False  # forgets all
    assert guard_managers() == before
    assert compiled_code.reuse_or_make_room("kind 0") is False


def test_a_kept_kind_that_compiled_again_has_everything_forgotten_at_the_next_load(fresh):
    assert compiled_code.reuse_or_make_room("kind") is False
    compiled_first_call(load(0))
    compiled_code.recompiled()  # what preparation says when a kept kind's step compiled
    before = guard_managers()
    assert compiled_code.reuse_or_make_room("kind") is False  # forgotten, not reused
    assert guard_managers() < before


def test_no_guard_manager_outlives_a_forget(fresh):
    before = guard_managers()
    for seed in range(2):
        compiled_first_call(load(seed))
        assert guard_managers() > before  # the compiled forward is guarded
        assert compiled_code.forget_compiled_code() >= 1
        assert guard_managers() == before


def test_no_tracing_state_of_a_dynamic_shape_compile_outlives_a_forget(fresh):
    """A compile with a symbolic size (the engine's batched step from 2 rows) leaves a ShapeEnv
    whose fake inputs hold its symbols from C++: a cycle the garbage collector cannot see, which
    kept every forget's ShapeEnv, FakeTensorMode and fake weights alive."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    def live() -> tuple[int, int]:
        gc.collect()
        objects = gc.get_objects()
        return (sum(type(o) is ShapeEnv for o in objects),
                sum(issubclass(type(o), FakeTensor) for o in objects))

    weight = torch.randn(8, 8)
    after_forgets = []
    for _ in range(4):
        step = torch.compile(lambda x: torch.relu(x @ weight), backend="aot_eager", dynamic=None)
        for rows in (1, 2, 4, 3):  # the row count symbolic from the second shape
            x = torch.ones(rows, 8)
            assert torch.allclose(step(x), torch.relu(x @ weight))
        compiled_code.forget_compiled_code()
        after_forgets.append(live())
    # torch keeps a little of the latest compile (one ShapeEnv, a few fakes) until the next:
    # the same after every forget, where each forget used to leave one more state behind.
    assert after_forgets == after_forgets[:1] * 4, after_forgets


def test_no_code_module_inductor_loaded_outlives_a_forget(fresh):
    """Inductor appends the module of every graph it compiles (or reads from its cache) to a
    registry it never empties: with the module's kernels (on a GPU, loaded on the device), a
    switch's compiled code stayed in the process after every forget. Compiled here through
    inductor on the CPU (its C++ kernels)."""
    from torch._inductor.codecache import PyCodeCache

    weight = torch.randn(8, 8)
    step = torch.compile(lambda x: torch.relu(x @ weight) + 1, backend="inductor", dynamic=False)
    x = torch.ones(2, 8)
    assert torch.allclose(step(x), torch.relu(x @ weight) + 1)
    modules = [weakref.ref(m) for m in PyCodeCache.modules]
    assert modules, "inductor's compile loaded no code module"
    del step
    compiled_code.forget_compiled_code()
    gc.collect()
    assert PyCodeCache.modules == []
    assert all(module() is None for module in modules)


class LinearStack(torch.nn.Module):
    """Four linear layers in a row: a small model to compile and forget."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def stack_summaries() -> tuple[int, int]:
    """(live stack summaries, those only C++ holds: a guard's, dynamo's guards being C++)."""
    gc.collect()
    summaries = [o for o in gc.get_objects() if type(o) is traceback.StackSummary]
    alone = sum(all(r is summaries or isinstance(r, types.FrameType)
                    for r in gc.get_referrers(summary)) for summary in summaries)
    return len(summaries), alone


def test_no_guard_of_a_forgotten_compile_outlives_the_forget(fresh):
    """Dynamo's guards live in C++ and keep the stack each was made at: a stack summary that
    only C++ holds after a forget belongs to a guard of forgotten code. On torch 2.11 the copy
    of each compile's guard tree that dynamo made for the skip_guard_eval_unsafe stance was never
    freed, and with it five such guards a compile of this model (its global state and input
    guards): more with every load of a switching app."""

    after_forgets = []
    for _ in range(3):
        compiled_code.reuse_or_make_room("a test's kind")  # as each load does before compiling
        model = LinearStack()
        step = torch.compile(model.forward, backend="eager")
        step(torch.ones(2, 8))
        del step, model
        compiled_code.forget_compiled_code()
        after_forgets.append(stack_summaries()[1])
    assert after_forgets == after_forgets[:1] * 3, after_forgets


def test_a_forget_empties_the_fake_tensor_dispatch_cache(fresh):
    """That cache is class-wide and keyed by the symbolic sizes of every compile: kept across
    resets, it held each forgotten compile's symbols for the life of the process."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer = torch.nn.Linear(8, 8)
    step = torch.compile(lambda x: torch.relu(layer(x)), backend="aot_eager", dynamic=True)
    step(torch.ones(3, 8))
    assert FakeTensorMode.cache_info().size > 0
    compiled_code.forget_compiled_code()
    assert FakeTensorMode.cache_info().size == 0


class CompiledStep:
    """The runner's decode step through a compiled forward (as cuda_graphs.GraphedBatchStep's,
    without the graph capture, which needs a GPU)."""

    def __init__(self, model):
        self.forward = torch.compile(model.forward, fullgraph=True, dynamic=False,
                                     backend="aot_eager")

    def __call__(self, kv, b):
        kv.prepare_decode(b)
        return self.forward(**kv.decode_args(b)).logits[:, -1]


def test_a_later_load_s_paged_decode_step_runs_the_code_compiled_for_the_earlier(fresh):
    """The decode step hands its cache's id to the attention op, and torch.compile keeps that
    id as a constant: a later load's steps must get the same ids for the kept code to apply."""
    from torch._dynamo.utils import counters

    from model_utils.runtime.paged_attention import use_paged_attention
    from model_utils.runtime.runner import BatchRunner

    compiles = []
    for seed in (1, 2):
        model = load(seed)
        assert use_paged_attention(model)
        runner = BatchRunner(model, context_tokens=64, max_batch=2, step_fn=CompiledStep(model),
                             kv_tokens=256)
        before = counters["stats"]["unique_graphs"]
        runner.warm_up((1, 2))
        compiles.append(counters["stats"]["unique_graphs"] - before)
        pool = weakref.ref(runner.kv.keys[0])
        del runner, model
        gc.collect()
        assert pool() is None  # the kept code holds no cache of an unloaded model
    assert compiles[0] >= 1 and compiles[1] == 0


def test_which_forward_a_kind_kept_is_known_while_its_code_is_kept():
    compiled_code.forget_compiled_code()
    chosen = {1: {"kept": "compiled", "compiled_ms": 5.0, "plain_ms": 7.0, "timed_before": True}}
    compiled_code.remember_choices("not kept", chosen)
    assert compiled_code.known_choices("not kept") == {}

    assert compiled_code.reuse_or_make_room("kind a") is False
    compiled_code.remember_choices("kind a", chosen)
    assert compiled_code.known_choices("kind a") == {
        1: {"kept": "compiled", "compiled_ms": 5.0, "plain_ms": 7.0}}
    compiled_code.forget_compiled_code()
    assert compiled_code.known_choices("kind a") == {}


def test_a_kind_unloaded_before_its_deferred_compiling_is_not_kept(fresh):
    """--compile-while-idle: a load registers its kind before compiling; unloaded before the
    idle compile ran, the kind is not kept, so its next load compiles (and times) anew rather
    than take a step it never compiled for kept code."""
    assert compiled_code.reuse_or_make_room("other kind") is False
    assert compiled_code.reuse_or_make_room("deferred kind") is False
    compiled_code.remember_choices("deferred kind", {1: {"kept": "plain"}})
    compiled_code.not_compiled("deferred kind")
    assert compiled_code.reuse_or_make_room("deferred kind") is False
    assert compiled_code.known_choices("deferred kind") == {}  # kept again, its choice gone
    assert compiled_code.reuse_or_make_room("other kind") is True  # the others stay


def test_loads_share_one_inductor_backend_that_dynamo_keeps():
    """Dynamo keeps every backend torch.compile hands it until a reset: a new one per load
    was an object left in the process by every switch. One per setting is made (compiling is
    not run here: it needs a C++ compiler on a CPU)."""
    from torch._dynamo.eval_frame import cached_backends

    from model_utils.runtime.cuda_graphs import compile_forward

    compile_forward(torch.nn.Linear(4, 4), "default")
    before = len(cached_backends)
    for _ in range(3):
        compiled = compile_forward(torch.nn.Linear(4, 4), "default")
    compile_forward(torch.nn.Linear(4, 4), "default", dynamic=None)  # another setting
    assert len(cached_backends) == before + 1
    assert callable(compiled) and getattr(compiled, "_torchdynamo_orig_callable", None)


def test_every_batch_size_is_compiled_unless_configured():
    """--compiled-rows by default: every batch size the engine decodes, for every model."""
    from model_utils.engine_config import EngineConfig
    from model_utils.runtime.preparation import DecodePreparation

    assert DecodePreparation(EngineConfig(max_batch=12), worker=None)._compiled_rows() == 12
    assert DecodePreparation(EngineConfig(max_batch=12, compiled_rows=1),
                             worker=None)._compiled_rows() == 1
