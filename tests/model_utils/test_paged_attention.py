"""The paged cache's attention: each row over its own tokens, wherever its blocks are.

The torch reference (what the CPU decodes with) against plain sdpa over each row's tokens; the
Triton decode kernel (what a GPU decodes with) against the reference, run by Triton's
interpreter on the CPU; the prefill and extend forwards against sdpa over the whole sequence.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_utils.runtime.paged_attention import NAME, PagedStep, paged_attention, reference_decode

from .triton_interpreter import patch_interpreter, run_interpreted


class Layer(torch.nn.Module):
    """What paged_attention reads of an attention module."""

    def __init__(self, groups: int, index: int = 0):
        super().__init__()
        self.num_key_value_groups, self.layer_idx, self.is_causal = groups, index, True


def scattered_rows(lengths, *, kv_heads, dim, page=16, dtype=torch.float32, seed=0):
    """Pools with each row's tokens in shuffled blocks, the table, and each row's own K/V.
    Every slot no row holds is NaN (the pools are not zeroed: nothing may read those) but the
    null block's, which padding rows read."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // page) for n in lengths) + 1
    blocks = 1 + sum(-(-n // page) for n in lengths) + 3
    keys = torch.full((blocks, page, kv_heads, dim), float("nan"), dtype=dtype)
    values = torch.full_like(keys, float("nan"))
    keys[0], values[0] = 0, 0
    order = (torch.randperm(blocks - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(lengths), width, dtype=torch.int32)
    own = []
    for row, n in enumerate(lengths):
        mine = [order.pop() for _ in range(-(-n // page))]
        table[row, :len(mine)] = torch.tensor(mine)
        slots = torch.tensor([mine[p // page] * page + p % page for p in range(n)])
        for pool in (keys, values):
            pool.view(-1, kv_heads, dim)[slots] = torch.randn(n, kv_heads, dim,
                                                              generator=g).to(dtype)
        own.append((keys.view(-1, kv_heads, dim)[slots], values.view(-1, kv_heads, dim)[slots]))
    return keys, values, table, torch.tensor(lengths, dtype=torch.int32), own


def sdpa_row(query, k, v, window=0):
    """One row, one query token: [q_heads, d] over k/v [n, kv_heads, d]."""
    groups = query.shape[0] // k.shape[1]
    if window:
        k, v = k[-window:], v[-window:]
    k = k.transpose(0, 1).repeat_interleave(groups, 0)[None].float()
    v = v.transpose(0, 1).repeat_interleave(groups, 0)[None].float()
    return F.scaled_dot_product_attention(query[None, :, None].float(), k, v)[0, :, 0]


@pytest.mark.parametrize("window", [0, 20])
def test_reference_decode_is_sdpa_over_each_rows_own_tokens(window):
    lengths = [1, 37, 16, 70]
    keys, values, table, lens, own = scattered_rows(lengths, kv_heads=2, dim=16)
    query = torch.randn(len(lengths), 8, 16)
    out = reference_decode(query, keys, values, table, lens, 16 ** -0.5, window,
                           longest=max(lengths))
    for row, (k, v) in enumerate(own):
        torch.testing.assert_close(out[row], sdpa_row(query[row], k, v, window))


KERNEL_CASES = [  # lengths, q_heads, kv_heads, dim, window, max_splits, split tokens, tile
    ([5], 4, 2, 32, 0, 8, 128, 128),  # the demo model's shape
    ([1, 100, 250], 28, 4, 128, 0, 8, 64, 32),  # Qwen2.5-7B's heads; rows across splits
    ([130, 17], 8, 8, 64, 0, 4, 32, 32),  # no grouping
    ([200, 64], 14, 2, 80, 50, 8, 32, 16),  # a head size no power of two; a sliding window
    ([700], 8, 1, 128, 0, 64, 16, 16),  # more splits than the row can use
    ([900, 3, 40], 28, 4, 128, 0, 4, 64, 64),  # a long row capped at max_splits
]


def check_kernel_cases() -> None:
    """Every case in fp32 and fp16 (the interpreter's bf16 dot is wrong: numpy has no bf16).
    Run under Triton's interpreter (triton_interpreter.run_interpreted)."""
    patch_interpreter()
    from model_utils.runtime.decode_kernel import paged_decode

    for lengths, q_heads, kv_heads, dim, window, splits, split, tile in KERNEL_CASES:
        for dtype, tolerance in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
            keys, values, table, lens, _ = scattered_rows(lengths, kv_heads=kv_heads, dim=dim,
                                                          dtype=dtype)
            query = torch.randn(len(lengths), q_heads, dim).to(dtype)
            out = paged_decode(query, keys, values, table, lens,
                               torch.tensor([split], dtype=torch.int32), dim ** -0.5, window,
                               splits, block_n=tile, warps=4)
            assert out.dtype == dtype and out.shape == query.shape
            expected = reference_decode(query.float(), keys.float(), values.float(), table,
                                        lens, dim ** -0.5, window, longest=max(lengths))
            error = ((out.float() - expected).norm() / expected.norm()).item()
            assert error < tolerance, (lengths, dim, window, dtype, error)
            print(f"{lengths} heads {q_heads}/{kv_heads} d {dim} window {window} {dtype}: "
                  f"relative error {error:.1e}")


def test_the_triton_decode_kernel_computes_the_reference():
    pytest.importorskip("triton")
    done = run_interpreted("tests.model_utils.test_paged_attention", "check_kernel_cases")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("relative error") == 2 * len(KERNEL_CASES), done.stdout


def causal_sdpa(query, key, value, groups):
    """Plain causal attention over a whole sequence ([1, heads, n, d]), GQA repeated."""
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(query, key, value, is_causal=True).transpose(1, 2)


def test_prefill_and_extend_write_the_pool_and_attend_as_one_causal_pass():
    torch.manual_seed(0)
    page, kv_heads, groups, dim, total, prefix = 16, 2, 3, 16, 45, 29
    query = torch.randn(1, kv_heads * groups, total, dim)
    key, value = torch.randn(1, kv_heads, total, dim), torch.randn(1, kv_heads, total, dim)
    pool_k = torch.zeros(8, page, kv_heads, dim)
    pool_v = torch.zeros_like(pool_k)
    blocks = [5, 2, 7]
    slots = torch.tensor([blocks[p // page] * page + p % page for p in range(total)])
    layer = Layer(groups)
    first = PagedStep("prefill", [pool_k], [pool_v], slots[:prefix])
    out_first, _ = paged_attention(layer, query[:, :, :prefix], key[:, :, :prefix],
                                   value[:, :, :prefix], None, paged=first)
    rest = PagedStep("extend", [pool_k], [pool_v], slots[prefix:], context=slots, prefix=prefix)
    out_rest, _ = paged_attention(layer, query[:, :, prefix:], key[:, :, prefix:],
                                  value[:, :, prefix:], None, paged=rest)
    expected = causal_sdpa(query, key, value, groups)
    torch.testing.assert_close(torch.cat([out_first, out_rest], 1), expected)
    stored = pool_k.view(-1, kv_heads, dim)[slots]
    torch.testing.assert_close(stored, key[0].transpose(0, 1))


def test_without_a_paged_step_it_is_transformers_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layer = Layer(4)
    query, key, value = torch.randn(2, 8, 5, 16), torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)
    mine, _ = paged_attention(layer, query, key, value, None, scaling=0.25)
    theirs, _ = sdpa_attention_forward(layer, query, key, value, None, scaling=0.25)
    assert torch.equal(mine, theirs)


def test_the_engine_decodes_an_sdpa_model_with_paged_attention(load_demo):
    engine = load_demo("fp32")
    assert engine.manager.loaded.model.config._attn_implementation == NAME


def test_the_split_size_spreads_a_step_over_the_gpu_and_never_below_a_tile():
    from model_utils.runtime.decode_kernel import BLOCK_N, split_size

    assert split_size(100, 4, 132) == BLOCK_N  # a short step: one tile per program
    long_among_short = split_size(16384 + 7 * 128, 4, 132)
    assert long_among_short % BLOCK_N == 0
    # the long row's tokens over about 2 x 132 programs of its 4 KV heads
    assert 16384 // long_among_short * 4 >= 132
