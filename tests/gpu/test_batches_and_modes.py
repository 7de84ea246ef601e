"""Batching and every mode of the table on the GPU, judged by log-probabilities: a request
alone against the same request among 7 and 31 others, and each quantized mode's engine path
against plain generate in the same mode (teacher-forced error against the fp32 copy of the
same dequantized weights)."""

from __future__ import annotations

import pytest
import torch

from model_utils.bench import logprob_check as check
from model_utils.bench import logprobs as bench_logprobs
from model_utils.bench.logprob_runs import engine_greedy, engine_teacher_forced
from model_utils.bench.peaked_model import sample_prompts
from model_utils.bench.per_mode import load_peer
from model_utils.loading.modes import MODES

from .conftest import gpu_marks, load_engine

pytestmark = gpu_marks()


@pytest.fixture(scope="module")
def bf16_32(peaked_gpu):
    engine = load_engine(peaked_gpu, "bf16", max_batch=32)
    assert "cuda-graphs" in engine.serving.decode_path, engine.status()
    yield engine
    engine.unload()


@pytest.mark.parametrize("batch", [8, 32])
def test_one_row_alone_and_inside_a_batch_are_close(peaked_gpu, bf16_32, batch):
    prompts = sample_prompts(peaked_gpu, batch, 48)
    alone = engine_greedy(bf16_32, prompts[:1], 64)
    together = engine_greedy(bf16_32, prompts, 64)
    assert bf16_32.serving.scheduler.peak_rows >= min(batch, 8)
    result = check.check_logprobs_close(alone, together[:1],
                                        tolerance=check.TOLERANCE[torch.bfloat16])
    assert result["close"], result
    # Teacher-forced on the same sequence: its row in a full batch sees the same distributions.
    sequence = prompts[0] + alone[0].tokens
    one = engine_teacher_forced(bf16_32, [sequence], 48)
    many = engine_teacher_forced(bf16_32, [sequence] + [p + s.tokens for p, s in
                                                        zip(prompts[1:], together[1:])], 48)
    stats = check.kl_stats(one, many[:1])
    assert stats["kl_max"] < 1e-2 and stats["top1_agreement"] > 0.97, stats


QUANTIZED = [name for name, mode in MODES.items() if mode.is_quantized]


@pytest.mark.parametrize("mode", ["bf16", "fp16", *QUANTIZED])
def test_every_mode_is_close_to_plain_generate_in_that_mode(peaked_gpu, mode):
    # nf4 compiles its one-row step; the others capture the plain forward only, which keeps
    # this test within minutes (each compile costs ~20 s).
    # 3 prompts alone and 6 together, 64 tokens each: the mean KL over 192 and 384 positions.
    # Over half of that the ratio moved by tenths between runs, as much as the limit.
    engine = load_engine(peaked_gpu, mode, max_batch=6, compiled_rows=1 if mode == "nf4" else 0)
    try:
        prompts = sample_prompts(peaked_gpu, 6, 48)
        found = bench_logprobs.engine_side(engine, prompts, [1, 6], 64, 3)
    finally:
        engine.unload()
    results = bench_logprobs.compare(load_peer(peaked_gpu, mode), found)
    for batch, result in results.items():
        assert result["close"], (batch, result["partings"])
        forced = result["teacher_forced"]
        assert forced["within_limit"], (batch, forced)
