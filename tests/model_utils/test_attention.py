"""The decode attention that packs a KV head's query heads: same results as transformers' sdpa."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from model_utils.runtime import attention


class GroupedAttention(torch.nn.Module):
    num_key_value_groups = 4
    is_causal = True


def decode_inputs(batch=3, kv_heads=2, slots=37, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * GroupedAttention.num_key_value_groups
    query = torch.randn(batch, heads, 1, dim, generator=g)
    key = torch.randn(batch, kv_heads, slots, dim, generator=g)
    value = torch.randn(batch, kv_heads, slots, dim, generator=g)
    mask = torch.rand(batch, 1, 1, slots, generator=g) > 0.3
    mask[..., -1] = True  # every row attends to its own slot, as in the batch cache
    return query, key, value, mask


def test_matmul_attention_equals_sdpa_over_repeated_kv_heads():
    query, key, value, mask = decode_inputs()
    groups = GroupedAttention.num_key_value_groups
    reference = F.scaled_dot_product_attention(query, repeat_kv(key, groups),
                                               repeat_kv(value, groups), attn_mask=mask)
    batch, heads, _, dim = query.shape
    packed = query.reshape(batch, heads // groups, groups, dim)
    out = attention._matmul_attention(packed, key, value, mask, None)
    torch.testing.assert_close(out.reshape(batch, heads, 1, dim), reference)
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    out = attention._matmul_attention(packed, key, value, additive, dim ** -0.5)
    torch.testing.assert_close(out.reshape(batch, heads, 1, dim), reference)


def test_packed_sdpa_gives_transformers_sdpa_output_for_decode_and_prefill():
    module = GroupedAttention()
    query, key, value, mask = decode_inputs()
    mine, _ = attention.packed_sdpa(module, query, key, value, mask, scaling=0.25)
    theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    assert mine.shape == theirs.shape == (3, 1, 8, 16)
    torch.testing.assert_close(mine, theirs)
    prefill = torch.randn(3, 8, 5, 16)  # several query tokens: transformers' own path
    mine, _ = attention.packed_sdpa(module, prefill, key[:, :, :5], value[:, :, :5], None)
    theirs, _ = sdpa_attention_forward(module, prefill, key[:, :, :5], value[:, :, :5], None)
    assert torch.equal(mine, theirs)


def test_the_engine_decodes_an_sdpa_model_with_packed_attention(load_demo):
    engine = load_demo("fp32")
    assert engine.manager.loaded.model.config._attn_implementation == attention.NAME
