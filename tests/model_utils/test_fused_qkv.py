"""One q/k/v matmul (model_utils/layers/fused_qkv.py): the same logits and greedy tokens as
transformers' own attention forward, with and without projection biases, and the same memory."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from model_utils.layers.fused_qkv import fuse_qkv


def tiny(config_class, seed: int):
    config = config_class(vocab_size=300, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=256)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def tiny_qwen2():  # q/k/v projections with biases
    return tiny(Qwen2Config, 0)


def tiny_llama():
    return tiny(LlamaConfig, 1)


def qwen3_demo(demo_path):
    return AutoModelForCausalLM.from_pretrained(demo_path, dtype=torch.float32)


def greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("build", [tiny_qwen2, tiny_llama, qwen3_demo],
                         ids=["qwen2-bias", "llama", "qwen3-qk-norm"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_fused_projections_give_the_same_logits_and_tokens(build, attention, demo_path):
    args = (demo_path,) if build is qwen3_demo else ()
    reference, model = build(*args), build(*args)
    for m in (reference, model):
        m.set_attn_implementation(attention)
    params = sum(p.numel() for p in model.parameters())
    layers = model.config.num_hidden_layers
    assert fuse_qkv(model) == layers
    assert sum(p.numel() for p in model.parameters()) == params  # moved, not copied
    attention_module = model.model.layers[0].self_attn
    assert not hasattr(attention_module, "q_proj") and hasattr(attention_module, "qkv_proj")
    assert_same_model(model, reference)


def assert_same_model(model, reference) -> None:
    """The same logits (fp32) over a 40-token sequence and the same 30 greedy tokens."""
    ids = torch.tensor([[5 + (7 * i) % 250 for i in range(40)]])
    with torch.inference_mode():
        expected, got = reference(ids).logits, model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    prompt = ids[0, :12].tolist()
    assert greedy(model, prompt, 30) == greedy(reference, prompt, 30)


def test_quantized_or_unknown_layers_are_left_alone(demo_path):
    from transformers import BitsAndBytesConfig

    model = AutoModelForCausalLM.from_pretrained(
        demo_path, quantization_config=BitsAndBytesConfig(load_in_4bit=True,
                                                          bnb_4bit_compute_dtype=torch.float32),
        device_map={"": "cpu"})
    assert fuse_qkv(model) == 0
    assert hasattr(model.model.layers[0].self_attn, "q_proj")
