"""Decode attention over the paged KV cache: one query token per row, each row reading only its
own tokens, in the cache's dtype, once. Triton; imported only where there is a CUDA GPU (and by
the tests, under Triton's interpreter on the CPU).

Why a kernel of our own: with one query token per KV head group there are only rows x kv_heads
blocks of work (4 for one Qwen2.5-7B reply), far too few to fill an H200's 132 SMs, so a plain
attention kernel leaves the card idle while one SM walks the whole context. Flash-decoding (the
design of SGLang's and vLLM's Triton decode kernels) splits each row's tokens over several
programs, each computing a partial softmax over its share, and a second small kernel merges the
partials by their log-sum-exp. Scores are accumulated in fp32 by tl.dot (the logprob checks
need that; casting K to fp32 first, as the old path did, copies the whole window every step).
sdpa cannot read a block table; torch's FlexAttention with a per-row block mask can, but it
has not been measured against this kernel here (benchmarks/decode_attention.py is where such a
comparison belongs).

The number of splits a row uses follows its length and the step's total (split_size: a short
reply beside a long one takes one program, the long one many), bounded by `max_splits`, which
the caller fixes per captured batch shape; the split size is a device scalar, so a captured
step follows the lengths without being captured again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tokens per inner-loop tile and warps per program: the best of a sweep on an H200 over one row
# of 4k and 32k tokens, 8 of 16k and 32 of 4k (benchmarks/decode_attention.py --tune).
BLOCK_N = 128
WARPS = 8
LOG2E = 1.4426950408889634


@triton.jit
def _row_split(Lens, SplitTokens, row, window, BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """(the row's length, its first attended token, tokens per split, splits used): the same
    numbers in both kernels, from the row's length and the step's split size."""
    seq_len = tl.load(Lens + row)
    start = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    span = seq_len - start
    splits = tl.minimum(tl.cdiv(span, tl.load(SplitTokens)), MAX_SPLITS)
    per_split = tl.cdiv(tl.cdiv(span, splits), BLOCK_N) * BLOCK_N
    return seq_len, start, per_split, tl.cdiv(span, per_split)


@triton.jit
def _partials(Q, K, V, Table, Lens, SplitTokens, Out, Lse,
              stride_qb, stride_qh,
              stride_kb, stride_ks, stride_kh,
              stride_vb, stride_vs, stride_vh,
              stride_tb,
              stride_ob, stride_oh, stride_os,
              stride_lb, stride_lh,
              scale_log2, window,
              GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_D: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
              MAX_SPLITS: tl.constexpr, IEEE: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len, start, per_split, _ = _row_split(Lens, SplitTokens, row, window, BLOCK_N,
                                              MAX_SPLITS)
    lo = start + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)
    if lo < hi:
        offs_h = tl.arange(0, BLOCK_H)
        heads = kv_head * GROUP + offs_h
        mask_h = offs_h < GROUP
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_D
        q = tl.load(Q + row * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_h[:, None] & mask_d[None, :], other=0.0)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        table = Table + row * stride_tb
        for n0 in range(lo, hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            page = tl.load(table + offs_n // PAGE, mask=mask_n, other=0).to(tl.int64)
            within = offs_n % PAGE
            k = tl.load(K + page[None, :] * stride_kb + within[None, :] * stride_ks
                        + kv_head * stride_kh + offs_d[:, None],
                        mask=mask_n[None, :] & mask_d[:, None], other=0.0)  # [D, N]
            if IEEE:
                qk = tl.dot(q, k, input_precision="ieee")
            else:
                qk = tl.dot(q, k)
            qk = tl.where(mask_n[None, :], qk * scale_log2, float("-inf"))  # [H, N], log2
            m_new = tl.maximum(m, tl.max(qk, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(qk - m_new[:, None])
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(V + page[:, None] * stride_vb + within[:, None] * stride_vs
                        + kv_head * stride_vh + offs_d[None, :],
                        mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # [N, D]
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m = m_new
        tl.store(Out + row * stride_ob + heads[:, None] * stride_oh + split * stride_os
                 + offs_d[None, :], acc / total[:, None], mask=mask_h[:, None] & mask_d[None, :])
        tl.store(Lse + row * stride_lb + heads * stride_lh + split, m + tl.log2(total),
                 mask=mask_h)


@triton.jit
def _combine(Part, Lse, Lens, SplitTokens, Out,
             stride_pb, stride_ph, stride_ps,
             stride_lb, stride_lh,
             stride_ob, stride_oh,
             window,
             HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
             MAX_SPLITS: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    _, _, _, used = _row_split(Lens, SplitTokens, row, window, BLOCK_N, MAX_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_D
    lses = Lse + row * stride_lb + head * stride_lh
    parts = Part + row * stride_pb + head * stride_ph + offs_d
    m = tl.load(lses)  # the first split, which every row has
    total = tl.exp2(m - m)
    acc = tl.load(parts, mask=mask_d, other=0.0)
    for s in range(1, used):
        lse = tl.load(lses + s)
        part = tl.load(parts + s * stride_ps, mask=mask_d, other=0.0)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        weight = tl.exp2(lse - m_new)
        acc = acc * alpha + part * weight
        total = total * alpha + weight
        m = m_new
    tl.store(Out + row * stride_ob + head * stride_oh + offs_d,
             (acc / total).to(Out.dtype.element_ty), mask=mask_d)


def paged_decode(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 table: torch.Tensor, lengths: torch.Tensor, split_tokens: torch.Tensor,
                 scale: float, window: int, max_splits: int, *, block_n: int = BLOCK_N,
                 warps: int = WARPS, stages: int = 2) -> torch.Tensor:
    """Attention of one query token per row over that row's cached tokens.

    query [b, q_heads, d]; keys/values [blocks, page, kv_heads, d] (the pool); table [b, width]
    int32 block numbers; lengths [b] int32 tokens each row attends to (its new token included,
    already written); split_tokens [1] int32, the fewest tokens one program takes (a multiple
    of block_n: split_size() of the step's rows); window > 0: only the last `window` tokens
    (sliding-window layers). Returns [b, q_heads, d] in the query's dtype. The keyword
    arguments are the kernel's tuning (benchmarks/decode_attention.py measures them)."""
    b, q_heads, d = query.shape
    _, page, kv_heads, _ = keys.shape
    group = q_heads // kv_heads
    block_d = max(16, triton.next_power_of_2(d))
    block_h = max(16, triton.next_power_of_2(group))
    parts = torch.empty(b, q_heads, max_splits, d, dtype=torch.float32, device=query.device)
    lse = torch.empty(b, q_heads, max_splits, dtype=torch.float32, device=query.device)
    out = torch.empty(b, q_heads, d, dtype=query.dtype, device=query.device)
    query = query.contiguous()
    ieee = query.dtype == torch.float32  # tl.dot would take fp32 inputs as tf32
    _partials[(b, kv_heads, max_splits)](
        query, keys, values, table, lengths, split_tokens, parts, lse,
        query.stride(0), query.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        table.stride(0),
        parts.stride(0), parts.stride(1), parts.stride(2),
        lse.stride(0), lse.stride(1),
        scale * LOG2E, window,
        GROUP=group, BLOCK_H=block_h, HEAD_D=d, BLOCK_D=block_d, BLOCK_N=block_n, PAGE=page,
        MAX_SPLITS=max_splits, IEEE=ieee, num_warps=warps, num_stages=stages)
    _combine[(b, q_heads)](
        parts, lse, lengths, split_tokens, out,
        parts.stride(0), parts.stride(1), parts.stride(2),
        lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        window,
        HEAD_D=d, BLOCK_D=block_d, BLOCK_N=block_n, MAX_SPLITS=max_splits, num_warps=1)
    return out


def split_size(total_tokens: int, kv_heads: int, sms: int, block_n: int = BLOCK_N) -> int:
    """The fewest tokens one program of a step takes: the step's tokens (all rows) spread over
    about twice as many programs as the GPU has SMs, at least one tile. So a long row among
    short ones gets many programs and the short ones one each, and a step of many long rows
    is not cut finer than the GPU can take at once."""
    per_program = -(-total_tokens * kv_heads // (2 * sms))
    return max(block_n, -(-per_program // block_n) * block_n)
