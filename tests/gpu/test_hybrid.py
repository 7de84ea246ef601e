"""Qwen3.5's hybrid layers on the GPU's compiled path: the tiny model of tests/model_utils/
test_hybrid.py in bf16, rows of mixed lengths decoded together (CUDA graphs, the linear layers'
states in their row slots) against plain generate of each alone, by the logprob check."""

from __future__ import annotations

import pytest
import torch

from model_utils.bench import logprob_check as check
from model_utils.bench.logprob_runs import engine_greedy, plain_greedy
from tests.model_utils.test_hybrid import build

from .conftest import gpu_marks, load_engine, plain

pytestmark = gpu_marks()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build(tmp_path_factory.mktemp("qwen3_5-gpu") / "tiny")


def assert_close_to_plain_generate(folder, prompts, together) -> None:
    """The engine's replies against plain generate of each prompt alone, by the logprob check."""
    reference = plain(folder, "bf16")
    alone = [plain_greedy(reference, [p], 24)[0] for p in prompts]
    result = check.check_logprobs_close(together, alone,
                                        tolerance=check.TOLERANCE[torch.bfloat16])
    assert result["close"], result["partings"]


@pytest.mark.parametrize("rows", [1, 7])
def test_hybrid_rows_on_the_graph_path_are_close_to_plain_generate(folder, rows):
    engine = load_engine(folder, "bf16", max_batch=8)
    try:
        assert "cuda-graphs" in engine.serving.decode_path, engine.status()
        prompts = [[(7 * j + 11 * i) % 900 + 5 for j in range(10 + 150 * i)]
                   for i in range(rows)]
        together = engine_greedy(engine, prompts, 24)
    finally:
        engine.unload()
    assert_close_to_plain_generate(folder, prompts, together)


def test_hybrid_next_turns_and_short_prompts_together_are_close_to_plain_generate(folder):
    """A next turn starting from the kept linear states (state_snapshots) and short prompts
    prefilled together, left-padded by CUDA graphs (left_padded_prefill), on the GPU."""
    engine = load_engine(folder, "bf16", max_batch=8)
    try:
        runner = engine.serving.scheduler.runner
        assert runner.padded_prefill is not None and not runner.padded_prefill.uncaptured
        runner.min_reuse_tokens = 16
        first = [(11 * j) % 700 + 7 for j in range(300)]
        engine_greedy(engine, [first], 8)
        second = first + [(3 * j) % 500 + 40 for j in range(40)]
        short = [[(7 * j + 11 * i) % 900 + 5 for j in range(20 + 30 * i)] for i in range(4)]
        prompts = [second, *short]
        together = engine_greedy(engine, prompts, 24)
        assert engine.serving.scheduler.kv_blocks()["reused_tokens"] >= 256
    finally:
        engine.unload()
    assert_close_to_plain_generate(folder, prompts, together)
