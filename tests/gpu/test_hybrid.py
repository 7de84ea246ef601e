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


class Slots:
    """A cache of one linear-attention layer's states as the engine keeps them (tensors of its
    own, contiguous), with or without the in-place decode step (layers/gated_delta.py)."""

    def __init__(self, conv, recurrent, updates_in_place):
        self.conv, self.recurrent, self.updates_in_place = conv, recurrent, updates_in_place

    def get_conv_state(self, layer_idx, state_idx=0):
        return self.conv

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return self.recurrent

    def is_recording_past(self, layer_idx):
        return False

    def update_recurrent_state(self, states, layer_idx, state_idx=0, **kwargs):
        if states is not self.recurrent:
            self.recurrent.copy_(states)
        return self.recurrent


@pytest.mark.parametrize("rows", [1, 5])
def test_the_in_place_decode_step_matches_transformers_path(rows):
    """fla's convolution and delta-rule kernels updating the states where they are, against
    transformers' own decode of the same layer (fla's kernel returning a new state), for a few
    tokens, at Qwen3.5-9B's head sizes."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    from model_utils.layers.gated_delta import fuse_gated_delta

    config = Qwen3_5TextConfig(hidden_size=512, num_hidden_layers=1,
                               layer_types=["linear_attention"], linear_key_head_dim=128,
                               linear_value_head_dim=128, linear_num_key_heads=2,
                               linear_num_value_heads=4)
    torch.manual_seed(0)
    layer = Qwen3_5GatedDeltaNet(config, layer_idx=0).to("cuda", torch.bfloat16)
    holder = torch.nn.ModuleDict({"linear_attn": layer})
    assert fuse_gated_delta(holder) == 1 and layer.decodes_in_place
    conv = torch.randn(rows, layer.conv_dim, layer.conv_kernel_size, device="cuda",
                       dtype=torch.bfloat16)
    recurrent = torch.randn(rows, 4, 128, 128, device="cuda") * 0.05
    fast = Slots(conv.clone(), recurrent.clone(), True)
    slow = Slots(conv.clone(), recurrent.clone(), False)
    with torch.inference_mode():
        for _ in range(6):
            hidden = torch.randn(rows, 1, 512, device="cuda", dtype=torch.bfloat16)
            got, expected = layer(hidden, cache=fast), layer(hidden, cache=slow)
            torch.testing.assert_close(got, expected, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(fast.conv, slow.conv, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fast.recurrent, slow.recurrent, rtol=2e-2, atol=2e-3)
