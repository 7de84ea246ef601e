"""The CUDA-graph paths against the eager ones and plain generate, on a trained small model."""

from __future__ import annotations

import time

import pytest
import torch

from model_utils.bench import logprob_check as check
from model_utils.bench.logprob_runs import engine_greedy, plain_greedy
from model_utils.bench.peaked_model import sample_prompts
from model_utils.runtime.prefill import PREFILL_BUCKETS

from .conftest import gpu_marks, plain

pytestmark = gpu_marks()


def test_graphed_decode_equals_eager_decode_in_fp32(peaked_gpu, fp32_graphed, fp32_eager):
    prompts = sample_prompts(peaked_gpu, 3, 40)
    graphed = engine_greedy(fp32_graphed, prompts, 96)
    eager = engine_greedy(fp32_eager, prompts, 96)
    assert [s.tokens for s in graphed] == [s.tokens for s in eager]
    reference = plain_greedy(plain(peaked_gpu, "fp32"), prompts, 96)
    assert [s.tokens for s in graphed] == [s.tokens for s in reference]
    result = check.check_logprobs_close(graphed, eager, tolerance=check.TOLERANCE[torch.float32])
    assert result["close"], result


def test_padded_prefill_graph_equals_eager_prefill(peaked_gpu, fp32_graphed):
    """The prefill graphs write each prompt's keys to its blocks and give its last logits as
    one eager forward of the prompt alone does; the shapes a load leaves for later are
    captured while the engine is idle."""
    runner = fp32_graphed.serving.scheduler.runner
    padded = runner.padded_prefill
    deadline = time.monotonic() + 120
    while padded.pending() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert padded is not None and not padded.pending() and not padded.uncaptured
    assert "failed to capture" not in fp32_graphed.status()["decode_path_reason"]
    prompts = [p[:n] for p, n in zip(sample_prompts(peaked_gpu, 3, 100), (100, 37, 64))]

    def run():
        pool, kv = runner.blocks(), runner.kv
        graphed = [pool.allocate(-(-len(p) // pool.block_size)) for p in prompts]
        eager = [pool.allocate(-(-len(p) // pool.block_size)) for p in prompts]
        try:
            with torch.inference_mode():
                graph_logits = padded(prompts, graphed).clone()
                eager_logits = torch.cat([runner.forward_prompt(p, b)
                                          for p, b in zip(prompts, eager)])
            keys = []
            for p, a, b in zip(prompts, graphed, eager):
                mine, theirs = (kv.slots_of(blocks, 0, len(p)) for blocks in (a, b))
                keys.append([(layer.view(-1, *layer.shape[2:])[mine],
                              layer.view(-1, *layer.shape[2:])[theirs]) for layer in kv.keys])
            return graph_logits, eager_logits, keys
        finally:
            for blocks in graphed + eager:
                pool.release(blocks)

    graph_logits, eager_logits, keys = fp32_graphed.worker.call(run)
    torch.testing.assert_close(graph_logits, eager_logits, atol=1e-4, rtol=1e-4)
    for per_layer in keys:
        for mine, theirs in per_layer:
            torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


def edges() -> list[int]:
    lengths = []
    for size in PREFILL_BUCKETS:
        lengths += [size - 1, size, size + 1]
    return lengths


@pytest.mark.parametrize("length", edges())
def test_prompt_lengths_at_every_prefill_bucket_edge_decode_as_plain_generate(
        peaked_gpu, fp32_graphed, length):
    text = sample_prompts(peaked_gpu, 1, length)
    graphed = engine_greedy(fp32_graphed, text, 8)
    reference = plain_greedy(plain_model(peaked_gpu), text, 8)
    assert graphed[0].tokens == reference[0].tokens


def test_long_replies_over_many_blocks_decode_as_plain_generate(peaked_gpu, fp32_graphed):
    prompts = sample_prompts(peaked_gpu, 2, 1000)  # prefilled eagerly, then 64 steps each
    graphed = engine_greedy(fp32_graphed, prompts, 64)
    reference = plain_greedy(plain_model(peaked_gpu), prompts, 64)
    assert [s.tokens for s in graphed] == [s.tokens for s in reference]


_PLAIN = {}


def plain_model(folder):
    if folder not in _PLAIN:  # one plain fp32 copy for the parametrized cases
        _PLAIN[folder] = plain(folder, "fp32")
    return _PLAIN[folder]


def test_a_step_compiled_while_idle_takes_over_and_decodes_the_same(peaked_gpu, fp32_eager):
    """--compile-while-idle: the load is ready on the plain forward's graph, the step is
    compiled once no reply decodes, both graphs are timed and the faster kept, and one reply
    decodes as the eager path's before and after (before: on whichever graph it finds)."""
    from model_utils.bench.measure import settle
    from model_utils.errors import LoadError
    from model_utils.loading.loaded_model import LoadRequest
    from model_utils.runtime import compiled_code

    from .conftest import CUDA, load_engine

    compiled_code.forget_compiled_code()  # a kind no earlier test of this process compiled
    engine = load_engine(peaked_gpu, "fp32", max_batch=4, compile_while_idle=True)
    try:
        status = engine.status()
        assert "until the compiled one is ready" in status["decode_path_reason"]
        # The stage as the clock names it: the progress line's words before their brackets
        # ("capturing the decode step (one reply; compiled while idle)").
        assert "capturing the decode step" in [s["stage"] for s in status["load_stages"]]
        # While the compile runs, the status says for how long (the chat page's notice:
        # server.replies.waiting_notice).
        deadline = time.monotonic() + 120
        while "compiling_for_s" not in status and time.monotonic() < deadline:
            time.sleep(0.02)
            status = engine.status()
        assert status.get("compiling_for_s", -1) >= 0, status
        # A refused load stops the idle work for a moment; the model serves on, and so does it.
        with pytest.raises(LoadError):
            engine.load(LoadRequest("/nonexistent/model", "fp32", CUDA))
        prompts = sample_prompts(peaked_gpu, 2, 40)
        eager = [s.tokens for s in engine_greedy(fp32_eager, prompts, 48, at_once=1)]
        assert [s.tokens for s in engine_greedy(engine, prompts, 48, at_once=1)] == eager
        settle(engine)
        step = engine.serving.scheduler.runner.step_fn
        assert engine.serving.idle_work_left() == 0 and step.compiles_pending() == 0
        assert "compiled_ms" in step.chosen[1] and "plain_ms" in step.chosen[1], step.chosen
        reason = engine.status()["decode_path_reason"]
        assert "until the compiled one" not in reason and "one-reply step: " in reason, reason
        assert [s.tokens for s in engine_greedy(engine, prompts, 48, at_once=1)] == eager
    finally:
        engine.unload()
