"""The CUDA-graph paths against the eager ones and plain generate, on a trained small model."""

from __future__ import annotations

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
    runner = fp32_graphed.manager.loaded.batcher.runner
    padded = runner.padded_prefill
    assert padded is not None and not padded.uncaptured
    prompts = [p[:n] for p, n in zip(sample_prompts(peaked_gpu, 3, 100), (100, 37, 64))]

    def run():
        with torch.inference_mode():
            logits, cache, ends = padded(prompts)
            graph_logits = logits.clone()
            graph_keys = [[layer.keys[i, :, :n].clone() for i, n in enumerate(ends)]
                          for layer in cache.layers]
            eager_logits, eager_cache = runner.forward_prompts([p for p in prompts])
            return graph_logits, graph_keys, eager_logits, eager_cache

    graph_logits, graph_keys, eager_logits, eager_cache = fp32_graphed.worker.call(run)
    torch.testing.assert_close(graph_logits, eager_logits, atol=1e-4, rtol=1e-4)
    width = max(len(p) for p in prompts)  # the eager forward left-pads
    for layer, keys in zip(eager_cache.layers, graph_keys):
        for i, k in enumerate(keys):
            n = len(prompts[i])
            torch.testing.assert_close(k, layer.keys[i, :, width - n:], atol=1e-4, rtol=1e-4)


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


def test_a_reply_crossing_a_cache_window_decodes_as_plain_generate(peaked_gpu, fp32_graphed):
    kv = fp32_graphed.manager.loaded.batcher.runner.kv
    assert kv.windows[:2] == (1024, 2048), kv.windows
    prompts = sample_prompts(peaked_gpu, 2, 1000)  # 1000 + 64: from window 1024 into 2048
    graphed = engine_greedy(fp32_graphed, prompts, 64)
    reference = plain_greedy(plain_model(peaked_gpu), prompts, 64)
    assert [s.tokens for s in graphed] == [s.tokens for s in reference]


_PLAIN = {}


def plain_model(folder):
    if folder not in _PLAIN:  # one plain fp32 copy for the parametrized cases
        _PLAIN[folder] = plain(folder, "fp32")
    return _PLAIN[folder]
