"""Projections fused into one matmul (model_utils/layers/decode_fusions.py): q/k/v, gate/up and
Qwen3.5's four linear-attention inputs. In fp32 on the CPU the fused model gives the logits and
greedy tokens of transformers' own forwards, holds the same parameters, decodes in the engine's
batches as the unfused model does alone, and the fp32 copy that the log-probability checks build
from a fused model is the unfused model again."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from model_utils.bench.logprob_check import fp32_copy
from model_utils.layers.decode_fusions import fuse_for_decoding

from .test_fused_qkv import assert_same_model, greedy, tiny
from .test_hybrid import build as build_hybrid
from .test_hybrid import greedy as greedy_settings
from .test_hybrid import load, submit, together


@pytest.fixture(scope="module")
def hybrid_folder(tmp_path_factory):
    return build_hybrid(tmp_path_factory.mktemp("qwen3_5") / "tiny", strong_states=True)


def builders(demo_path, hybrid_folder):
    return {
        "qwen2-bias": lambda: tiny(Qwen2Config, 0),
        "llama": lambda: tiny(LlamaConfig, 1),
        "qwen3-demo": lambda: AutoModelForCausalLM.from_pretrained(demo_path,
                                                                   dtype=torch.float32),
        "qwen3.5-hybrid": lambda: AutoModelForCausalLM.from_pretrained(hybrid_folder,
                                                                       dtype=torch.float32),
    }


EXPECTED = {  # what each model has to fuse
    "qwen2-bias": ["q/k/v", "gate/up"], "llama": ["q/k/v", "gate/up"],
    "qwen3-demo": ["q/k/v", "gate/up"],
    "qwen3.5-hybrid": ["q/k/v", "gate/up", "linear-attention input"],
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_fused_models_give_the_same_logits_tokens_and_parameters(name, demo_path,
                                                                  hybrid_folder):
    build = builders(demo_path, hybrid_folder)[name]
    reference, model = build(), build()
    params = sum(p.numel() for p in model.parameters())
    done = fuse_for_decoding(model)
    assert [d.split(" matmul")[0].removeprefix("one ") for d in done] == EXPECTED[name]
    assert sum(p.numel() for p in model.parameters()) == params  # moved, not copied
    assert fuse_for_decoding(model) == []  # a second call finds nothing left to fuse
    assert_same_model(model, reference)


@pytest.mark.parametrize("name", ["qwen2-bias", "qwen3.5-hybrid"])
def test_the_fp32_copy_of_a_fused_model_is_the_unfused_model(name, demo_path, hybrid_folder):
    build = builders(demo_path, hybrid_folder)[name]
    reference, model = build(), build()
    fuse_for_decoding(model)
    copy = fp32_copy(model)
    assert not hasattr(copy.model.layers[0].mlp, "gate_up_proj")
    ids = torch.tensor([[9 + (11 * i) % 250 for i in range(33)]])
    with torch.inference_mode():
        torch.testing.assert_close(copy(ids).logits, reference(ids).logits, rtol=1e-5,
                                   atol=1e-5)


def test_a_fused_hybrid_decodes_in_batches_as_the_unfused_model_alone(hybrid_folder):
    """The fused forwards reading and writing the engine's state slots
    (runtime/linear_states.StateView): prefill, chunked or not, and batched decode steps."""
    reference = AutoModelForCausalLM.from_pretrained(hybrid_folder, dtype=torch.float32)
    engine = load(hybrid_folder, max_batch=4)
    try:
        serving = engine.serving
        # The linear-attention layers are fused on every batched path (preparation.py), the
        # rest where the step compiles: here, by hand.
        assert serving.scheduler.runner.keeps_mid_forward
        assert "q/k/v" in " ".join(fuse_for_decoding(serving.loaded.model))
        prompts = [[(7 * j + 11 * i) % 900 + 5 for j in range(3 + (i * 97) % 260)]
                   for i in range(3)]
        lengths = [14, 9, 20]
        expected = [greedy(reference, p, n) for p, n in zip(prompts, lengths)]
        got = together([lambda p=p, n=n: submit(serving, p, greedy_settings(n))
                        for p, n in zip(prompts, lengths)])
        assert [tokens for tokens, _ in got] == expected
        assert max(stats.batched_with for _, stats in got) > 1
    finally:
        engine.unload()
