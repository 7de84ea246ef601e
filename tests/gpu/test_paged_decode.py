"""The paged KV cache on the GPU: the Triton decode kernel against the torch reference, rows of
mixed lengths decoded together against plain generate one by one, and a conversation's next
turn that reuses its start. Judged by log-probabilities (logprob_check), on the trained model."""

from __future__ import annotations

import threading

import pytest
import torch

from model_utils.bench import logprob_check as check
from model_utils.bench.logprob_runs import engine_greedy, greedy_settings, plain_greedy
from model_utils.bench.peaked_model import sample_prompts
from model_utils.engine import eos_ids
from model_utils.runtime.paged_attention import reference_decode
from model_utils.runtime.reply_stats import ReplyStats
from tests.model_utils.test_paged_attention import scattered_rows

from .conftest import gpu_marks, load_engine, plain

pytestmark = gpu_marks()

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7, 31])
def test_the_kernel_computes_the_reference_for_rows_of_mixed_lengths(dtype, rows):
    from model_utils.runtime.decode_kernel import paged_decode

    g = torch.Generator().manual_seed(rows)
    lengths = torch.randint(1, 5000, (rows,), generator=g).tolist()
    keys, values, table, lens, _ = scattered_rows(lengths, kv_heads=4, dim=128, dtype=dtype)
    keys, values, table, lens = (t.cuda() for t in (keys, values, table, lens))
    query = torch.randn(rows, 28, 128, generator=g).to(dtype).cuda()
    for splits, split, window in ((1, 128, 0), (8, 256, 0), (64, 128, 0), (16, 384, 700)):
        out = paged_decode(query, keys, values, table, lens,
                           torch.tensor([split], dtype=torch.int32, device="cuda"),
                           128 ** -0.5, window, splits)
        expected = reference_decode(query.float(), keys.float(), values.float(), table, lens,
                                    128 ** -0.5, window, longest=max(lengths))
        error = ((out.float() - expected).norm() / expected.norm()).item()
        assert error < TOLERANCE[dtype], (splits, window, error)


@pytest.fixture(scope="module")
def bf16_long(peaked_gpu):
    """bf16 on the compiled path, 32 rows, a context for prompts of up to 3500 tokens."""
    engine = load_engine(peaked_gpu, "bf16", max_batch=32, context=4096)
    assert "cuda-graphs" in engine.serving.decode_path, engine.status()
    yield engine
    engine.unload()


def mixed_prompts(folder, rows: int) -> list[list[int]]:
    lengths = [40 + (i * 733) % 3400 for i in range(rows)]  # 40 to ~3400 tokens
    pool = sample_prompts(folder, rows, max(lengths))
    return [p[:n] for p, n in zip(pool, lengths)]


@pytest.mark.parametrize("rows", [1, 7, 31])
def test_rows_of_mixed_lengths_decode_together_as_each_does_with_plain_generate(
        peaked_gpu, bf16_long, rows):
    prompts = mixed_prompts(peaked_gpu, rows)
    together = engine_greedy(bf16_long, prompts, 32)
    reference = plain(peaked_gpu, "bf16")
    alone = [plain_greedy(reference, [p], 32)[0] for p in prompts]
    result = check.check_logprobs_close(together, alone,
                                        tolerance=check.TOLERANCE[torch.bfloat16])
    assert result["close"], result["partings"]


def test_the_next_turn_finds_its_start_in_the_cache_and_decodes_as_plain_generate(
        peaked_gpu, bf16_long):
    serving = bf16_long.serving
    first = sample_prompts(peaked_gpu, 1, 1500)[0]  # longer than the padded prefill takes
    reply = engine_greedy(bf16_long, [first], 32)[0].tokens
    follow = first + reply + sample_prompts(peaked_gpu, 2, 20)[1]
    stats, record = ReplyStats(), []
    tokens = list(serving.scheduler.submit(follow, greedy_settings(32), eos_ids=eos_ids(serving.loaded),
                                        stop=threading.Event(), stats=stats, logprobs=record))
    assert stats.cached_tokens >= 1500, stats
    mine = check.steps_from_topk(tokens, record)
    theirs = plain_greedy(plain(peaked_gpu, "bf16"), [follow], 32)[0]
    result = check.check_logprobs_close([mine], [theirs],
                                        tolerance=check.TOLERANCE[torch.bfloat16])
    assert result["close"], result["partings"]
