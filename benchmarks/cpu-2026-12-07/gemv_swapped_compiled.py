"""The GEMV's tensor-core kernel with its operands swapped, compiled for a Hopper GPU here (no
GPU): the weights as tl.dot's first operand ([outputs, inputs], the way MSLK's atom lays a
tensor-core A fragment out) and x transposed as the second ([inputs, rows]), against
mslk_gemv._rows_kernel's x @ weights. The same counts as benchmarks/gemv_compiled.py
(registers, spills, layout conversions in the innermost loop, instructions a weight): whether
the swap is worth a GPU timing. A sketch for that question only: its split shares are left in
the workspace (no last-share collect).

    python benchmarks/cpu-2026-12-07/gemv_swapped_compiled.py
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import gemv_compiled  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from model_utils.layers import mslk_gemv  # noqa: E402

mslk_gemv._define_helpers()
_as_float = mslk_gemv._as_float


@triton.jit
def rows_swapped(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, space_ptr, count_ptr, M, N, K, stride_xm,
                 one_bits, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, CHUNK: tl.constexpr):
    R8: tl.constexpr = BLOCK_N // 2
    KB: tl.constexpr = BLOCK_K // 16
    pair = tl.program_id(0) * R8 + tl.arange(0, R8)
    kt = tl.arange(0, KB)
    t0 = tl.arange(0, 4)
    words = ((pair // 8)[:, None, None] * 32 + (pair % 8)[:, None, None] * 4
             + kt[None, :, None] * (N // 16) * 32 + t0[None, None, :])  # [R8, KB, 4]
    word_ok = ((pair // 8) * 16 < N)[:, None, None]
    step_words = KB * (N // 16) * 32
    m = tl.arange(0, BLOCK_M)
    xt_at = m[None, :] * stride_xm + tl.arange(0, BLOCK_K)[:, None]   # [BLOCK_K, BLOCK_M]
    m_ok = (m < M)[None, :]
    column = tl.arange(0, BLOCK_N)
    out_pair = tl.program_id(0) * R8 + column // 2
    row = (out_pair // 8) * 16 + 8 * (column % 2) + out_pair % 8
    row_ok = row < N
    chunks = K // CHUNK
    per_split = tl.cdiv(chunks, SPLIT_K)
    first = tl.program_id(1) * per_split
    last = tl.minimum(first + per_split, chunks)
    y = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    w_at = w_ptr + words
    for chunk in range(first, last):
        group = chunk * CHUNK // GROUP
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        x_sum = tl.zeros([BLOCK_K, BLOCK_M], dtype=tl.float32)
        for step in tl.static_range(CHUNK // BLOCK_K):
            k0 = chunk * CHUNK + step * BLOCK_K
            word = tl.load(w_at + (k0 // BLOCK_K) * step_words, mask=word_ok,
                           other=0, eviction_policy="evict_first") ^ -2004318072
            xt = tl.load(x_ptr + k0 + xt_at, mask=m_ok, other=0.0)
            x_sum += xt.to(tl.float32)
            # nibble p = v_r + 2 v8 + 4 v1 -> [R8, KB, t0, v1, v8, v_r]
            low = tl.join(tl.join(_as_float(word, 0, one_bits), _as_float(word, 1, one_bits)),
                          tl.join(_as_float(word, 2, one_bits), _as_float(word, 3, one_bits)))
            high = tl.join(tl.join(_as_float(word, 4, one_bits), _as_float(word, 5, one_bits)),
                           tl.join(_as_float(word, 6, one_bits), _as_float(word, 7, one_bits)))
            f = tl.permute(tl.join(low, high), (0, 5, 1, 4, 2, 3))  # (R8, v_r), (kt, v8, t0, v1)
            acc = tl.dot(f.reshape(BLOCK_N, BLOCK_K).to(xt.dtype), xt, acc)
        s = tl.load(s_ptr + group * N + row, mask=row_ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + group * N + row, mask=row_ok, other=0.0).to(tl.float32)
        y += acc * (16.0 * s)[:, None] + tl.sum(x_sum, axis=0)[None, :] * (z - 24.0 * s)[:, None]
    at = m[None, :] * N + row[:, None]
    store_ok = m_ok & row_ok[:, None]
    tl.atomic_add(space_ptr + at, y, mask=store_ok, sem="relaxed")

LAUNCHES = [(8, 64, 64, 4, 4), (8, 128, 64, 4, 4), (16, 128, 32, 4, 4)]
for name, kernel in (("x @ weights (mslk_gemv)", mslk_gemv._rows_kernel()),
                     ("weights @ x.T (swapped)", rows_swapped)):
    mslk_gemv._rows_kernel = lambda kernel=kernel: kernel  # what gemv_compiled compiles
    for launch in LAUNCHES:
        print(name, gemv_compiled.report(*launch), flush=True)
