"""A few rows times the int4 weights MSLK holds: a Triton GEMV over MSLK's own packed copy.

MSLK's CUTLASS GEMM (mslk_int4) is the fastest int4 product here from about sixteen rows up and
at prefill, but its tiles are made for many rows: at one to eight, a decode step's, it was
slower than gemlite's GEMV on every linear shape of the 7B and at times slower than bf16
(BENCHMARKS.md, "int4-wo's numbers through MSLK's CUTLASS kernel"). MSLK has no GEMV, gemlite's
cannot read MSLK's copy, and a second packed copy would double the weights' memory: so this
kernel reads MSLK's copy itself, through the layout mslk_layout read off MSLK's preshuffle.

The numbers (mslk_int4): nibble q ^ 8 (q - 8 as 4-bit two's complement), scales and zero points
[K/group, N] bf16, w = (q - 8) * scale + zero. Each program computes BLOCK_N outputs over its
share of K (SPLIT_K shares, summed by atomic adds into fp32 when more than one) in chunks of
BLOCK_K inputs within one group; a weight's nibble is found through the layout's table, so the
loads gather bytes within whole atoms (contiguous 128-byte runs). One row: products kept per
(output, input) in fp32 until the end, no reduction across threads inside the loop. Two to
sixteen rows: the chunk is dequantized to x's dtype and multiplied by tensor cores (tl.dot).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from .mslk_layout import Layout

MOST_ROWS = 16  # tl.dot's smallest tile; more rows go to MSLK's own kernel


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gemv(x_ptr, w_ptr, s_ptr, z_ptr, table_ptr, y_ptr, M, N, K, stride_xm,
             GROUP: tl.constexpr, ATOM_N: tl.constexpr, ATOM_K: tl.constexpr,
             ROWS_FIRST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
        ATOM: tl.constexpr = ATOM_N * ATOM_K
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        kk = tl.arange(0, BLOCK_K)
        # Where each weight of a chunk lies, relative to the chunk's first atom: its atom's
        # place (atoms rows first or inputs first) and its nibble within the atom (the table).
        within = tl.load(table_ptr + (n % ATOM_N)[:, None] * ATOM_K + (kk % ATOM_K)[None, :])
        if ROWS_FIRST:
            tile = (kk // ATOM_K)[None, :] * (N // ATOM_N) + (n // ATOM_N)[:, None]
            chunk_bytes = (BLOCK_K // ATOM_K) * (N // ATOM_N) * (ATOM // 2)
        else:
            tile = (n // ATOM_N)[:, None] * (K // ATOM_K) + (kk // ATOM_K)[None, :]
            chunk_bytes = (BLOCK_K // ATOM_K) * (ATOM // 2)
        nibble = tile * ATOM + within
        byte = nibble >> 1
        shift = (nibble & 1) * 4
        chunks = K // BLOCK_K
        per_split = tl.cdiv(chunks, SPLIT_K)
        first = tl.program_id(1) * per_split
        last = tl.minimum(first + per_split, chunks)
        if BLOCK_M == 1:
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        else:
            m = tl.arange(0, BLOCK_M)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for chunk in range(first, last):
            k0 = chunk * BLOCK_K
            w = tl.load(w_ptr + chunk * chunk_bytes + byte, mask=n_ok[:, None], other=0)
            q = ((((w.to(tl.int32) >> shift) & 15) ^ 8) - 8).to(tl.float32)
            group = k0 // GROUP
            s = tl.load(s_ptr + group * N + n, mask=n_ok, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + group * N + n, mask=n_ok, other=0.0).to(tl.float32)
            weight = q * s[:, None] + z[:, None]
            if BLOCK_M == 1:
                x = tl.load(x_ptr + k0 + kk).to(tl.float32)
                acc += weight * x[None, :]
            else:
                x = tl.load(x_ptr + m[:, None] * stride_xm + (k0 + kk)[None, :],
                            mask=(m < M)[:, None], other=0.0)
                acc += tl.dot(x, tl.trans(weight.to(x.dtype)))
        if BLOCK_M == 1:
            out = tl.sum(acc, axis=1)[None, :]
            rows = tl.arange(0, 1)
        else:
            out = acc
            rows = m
        where = y_ptr + rows[:, None] * N + n[None, :]
        ok = (rows < M)[:, None] & n_ok[None, :]
        if SPLIT_K == 1:
            tl.store(where, out.to(y_ptr.dtype.element_ty), mask=ok)
        else:
            tl.atomic_add(where, out, mask=ok)

    return gemv


# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) by GPU, weight shape and row count: the
# fastest `benchmarks/int4_kernels.py --gemv-search` found (CONFIGS_FILE: {GPU name: {"NxK":
# {"rows": [...]}}}); the nearest searched row count at or above a call's, else DEFAULT. No
# tuning at load: a switch waits for none.
CONFIGS_FILE = Path(__file__).with_name("mslk_gemv_configs.json")
DEFAULT = (32, 128, 1, 4, 2)
SEARCHED = [(block_n, block_k, split_k, warps, 2)
            for block_n in (16, 32, 64) for block_k in (64, 128) for split_k in (1, 2, 4, 8)
            for warps in (4,)] + [(32, 128, 4, 8, 2), (64, 128, 2, 8, 2), (16, 64, 8, 2, 2),
                                  (32, 64, 4, 2, 3), (128, 64, 1, 8, 2), (128, 128, 2, 8, 2)]


@functools.cache
def _configs(gpu: str) -> dict:
    found = json.loads(CONFIGS_FILE.read_text()) if CONFIGS_FILE.exists() else {}
    return found.get(gpu, {})


def config(n: int, k: int, rows: int, device: torch.device) -> tuple[int, ...]:
    by_rows = _configs(torch.cuda.get_device_name(device)).get(f"{n}x{k}", {})
    fitting = sorted(int(r) for r in by_rows if int(r) >= rows)
    return tuple(by_rows[str(fitting[0])]) if fitting else DEFAULT


def gemv(x2: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
         table: torch.Tensor, layout: Layout, *, launch: tuple[int, ...] | None = None
         ) -> torch.Tensor:
    """x2 [M, K] (M <= MOST_ROWS) @ the weight [N, K/2] MSLK's copy holds (module doc).T:
    [M, N] in x2's dtype. `table`: layout.table on x2's device, int32 (the kernel reads that,
    not layout.table); `launch`: (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) instead of
    config()'s."""
    rows, k = x2.shape
    n, groups = weight.shape[0], scales.shape[0]
    if (rows > MOST_ROWS or weight.shape[1] * 2 != k or scales.shape != (groups, n)
            or zeros.shape != (groups, n) or k % groups):
        raise ValueError(f"MSLK GEMV: x {tuple(x2.shape)}, weight {tuple(weight.shape)}, "
                         f"scales {tuple(scales.shape)}, zeros {tuple(zeros.shape)} do not fit")
    group = k // groups
    block_n, block_k, split_k, warps, stages = launch or config(n, k, rows, x2.device)
    block_k = min(block_k, group)
    if group % block_k or n % layout.atom_n or block_k % layout.atom_k:
        raise ValueError(f"MSLK GEMV: a {n}x{k} weight in groups of {group} does not tile by "
                         f"{block_k} inputs and {layout.atom_n}x{layout.atom_k} atoms")
    x2 = x2.contiguous()
    y = (torch.empty(rows, n, dtype=x2.dtype, device=x2.device) if split_k == 1
         else torch.zeros(rows, n, dtype=torch.float32, device=x2.device))
    _kernel()[(-(-n // block_n), split_k)](
        x2, weight, scales, zeros, table, y, rows, n, k, x2.stride(0), GROUP=group,
        ATOM_N=layout.atom_n, ATOM_K=layout.atom_k, ROWS_FIRST=layout.rows_first,
        BLOCK_M=1 if rows == 1 else MOST_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT_K=split_k, num_warps=warps, num_stages=stages)
    return y if split_k == 1 else y.to(x2.dtype)


@torch.library.custom_op("qwen_chat::mslk_gemv", mutates_args=())
def gemv_op(x2: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
            table: torch.Tensor, atom_n: int, atom_k: int, rows_first: bool) -> torch.Tensor:
    """gemv as one op that torch.compile and CUDA graphs take whole (the layout by its fields)."""
    return gemv(x2, weight, scales, zeros, table, Layout(atom_n, atom_k, rows_first, ()))


@gemv_op.register_fake
def _(x2, weight, scales, zeros, table, atom_n, atom_k, rows_first):
    return x2.new_empty(x2.shape[0], weight.shape[0])
