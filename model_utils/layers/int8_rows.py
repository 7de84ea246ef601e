"""int8-wo's weights kept in the order of Hopper's tensor-core fragments, and a few rows times
them through tensor cores with the weights as the first operand (as mslk_rows for int4).

The copy: atoms of 16 outputs x 16 inputs, one after another down the outputs first, then along
the inputs (as MSLK's int4 atom); in an atom, word 32 v_r + 4 t1 + t0 holds the four weights of
output t1 + 8 v_r at inputs 2 t0, 2 t0 + 8, 2 t0 + 1, 2 t0 + 9 (bytes 0-3): the values lane
4 t1 + t0 of a warp holds in its wgmma fragment, one 32-bit load a word (int8-wo's [N, K] copy
gave a thread its four numbers in two places: benchmarks/cpu-2026-12-07/int8_rows_sketch.py).

The numbers: bf16 holds 128 + u exactly for a 4-bit u, not for a byte, so each weight q
(-127..127) is two numbers the tensor cores take, q = 16 h + l with h = q >> 4 (-8..7) and
l = q & 15. Bytes 0 and 2 hold inputs 2 t0 and 2 t0 + 1: one LOP3 ((word & 0x000F000F) |
128.0's bits) makes the register of their two 128 + l, one more on the word shifted by 4
(XOR-ing 8 into the high nibble) their 136 + h, and the same shifted by 8 and 12 for bytes 1
and 3. Two products: Sum x q = 16 Sum x (136 + h) + Sum x (128 + l) - 2304 Sum x, in fp32,
times the output's scale at the end; Sum x by the tensor cores from a tile of ones.

Not one of the app's modes: a candidate the benchmark swaps into int8-wo
(benchmarks/quant_swaps.py, int8-wo-rows), timed before anything uses it. Off a GPU (Triton's
interpreter, which runs no inline asm) the same numbers come from shifts and masks.
"""

from __future__ import annotations

import functools

import torch

from . import mslk_gemv, mslk_rows

OFFSET = 16 * 136 + 128  # what the two numbers carry, summed over q = 16 h + l
MOST_ROWS = mslk_gemv.MOST_ROWS  # a reply step's rows: one block of rows, K split in shares
DEFAULT = (128, 64, 4, 4, 3)  # BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages
# more rows (a prompt's) in blocks of PROMPT_BLOCK_M, each program the whole K (no shares)
PROMPT_BLOCK_M = 64
PROMPT_LAUNCH = (64, 64, 1, 4, 3)


def pack(q: torch.Tensor) -> torch.Tensor:
    """int8-wo's q (int8 [N, K]) in the fragment order of the module doc: int8 [N, K]."""
    n, k = q.shape
    if n % 16 or k % 16:
        raise ValueError(f"an int8 weight of {n}x{k} is not whole 16x16 atoms")
    # (16 an + 8 v_r + t1, 16 ak + 8 v8 + 2 t0 + v1) -> atom (ak, an), word 32 v_r + 4 t1 + t0,
    # byte 2 v1 + v8
    parts = q.reshape(n // 16, 2, 8, k // 16, 2, 4, 2)  # an, v_r, t1, ak, v8, t0, v1
    return parts.permute(3, 0, 1, 2, 5, 6, 4).reshape(n, k).contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """pack's inverse: q int8 [N, K] in the natural order."""
    n, k = packed.shape
    parts = packed.reshape(k // 16, n // 16, 2, 8, 4, 2, 2)  # ak, an, v_r, t1, t0, v1, v8
    return parts.permute(1, 2, 3, 0, 6, 4, 5).reshape(n, k)


_nibbles_asm = _nibbles_plain = _last_share = _collect = None


def _define_helpers() -> None:
    """Triton is imported here, not with the module: the app imports this module off a GPU."""
    global _nibbles_asm, _nibbles_plain, _last_share, _collect
    if _nibbles_asm is not None:
        return
    import triton
    import triton.language as tl

    mslk_gemv._define_helpers()

    @triton.jit
    def nibbles_asm(b, HIGH: tl.constexpr):
        """A word's bytes [..., 4] -> bf16 [..., 4]: 128 + l (HIGH: 136 + h) of inputs 2 t0,
        2 t0 + 1 (bytes 0 and 2, one register), then 2 t0 + 8, 2 t0 + 9 (bytes 1 and 3)."""
        if HIGH:
            return tl.inline_asm_elementwise(
                asm="""{
                .reg .b32 t;
                shr.b32 t, $2, 4;
                lop3.b32 $0, t, 0x000F000F, 0x43084308, 0x6a;
                shr.b32 t, $2, 12;
                lop3.b32 $1, t, 0x000F000F, 0x43084308, 0x6a;
                }""",
                constraints="=r,=r,r", args=[b], dtype=tl.bfloat16, is_pure=True, pack=4)
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t;
            lop3.b32 $0, $2, 0x000F000F, 0x43004300, 0xea;
            shr.b32 t, $2, 8;
            lop3.b32 $1, t, 0x000F000F, 0x43004300, 0xea;
            }""",
            constraints="=r,=r,r", args=[b], dtype=tl.bfloat16, is_pure=True, pack=4)

    @triton.jit
    def nibbles_plain(b, HIGH: tl.constexpr, dtype: tl.constexpr):
        """nibbles_asm's numbers by shifts and masks (Triton's interpreter runs no asm), for
        b [NA, KB, 2, 8, 4, 4]: bytes 2 v1 + v8 put in the order 2 v8 + v1."""
        NA: tl.constexpr = b.shape[0]
        KB: tl.constexpr = b.shape[1]
        u = b.to(tl.int32) & 0xFF
        if HIGH:
            u = (u >> 4) ^ 8
        else:
            u = u & 15
        u = tl.permute(u.reshape(NA, KB, 2, 8, 4, 2, 2), (0, 1, 2, 3, 4, 6, 5))
        return (u.reshape(NA, KB, 2, 8, 4, 4).to(tl.float32) + 128.0).to(dtype)

    _nibbles_asm, _nibbles_plain = nibbles_asm, nibbles_plain
    _last_share, _collect = mslk_gemv._last_share, mslk_gemv._collect


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    _define_helpers()

    @triton.jit
    def rows(x_ptr, w_ptr, s_ptr, y_ptr, space_ptr, count_ptr, M, N, K, stride_xm,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             SPLIT_K: tl.constexpr, OFFSET_SUM: tl.constexpr, ASM: tl.constexpr):
        NA: tl.constexpr = BLOCK_N // 16
        KB: tl.constexpr = BLOCK_K // 16
        an = tl.program_id(0) * NA + tl.arange(0, NA)
        kt = tl.arange(0, KB)
        v_r = tl.arange(0, 2)
        t1 = tl.arange(0, 8)
        t0 = tl.arange(0, 4)
        byte = tl.arange(0, 4)
        # the bytes of a step [NA, KB, 2, 8, 4, 4]: atom (kt, an) at byte (kt N/16 + an) 256
        at = ((kt[None, :, None, None, None, None] * (N // 16)
               + an[:, None, None, None, None, None]) * 256
              + v_r[None, None, :, None, None, None] * 128
              + t1[None, None, None, :, None, None] * 16
              + t0[None, None, None, None, :, None] * 4 + byte[None, None, None, None, None, :])
        ok = (an * 16 < N)[:, None, None, None, None, None]
        step_bytes = KB * (N // 16) * 256
        m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        xt_at = tl.arange(0, BLOCK_K)[:, None] + m[None, :] * stride_xm
        m_ok = (m < M)[None, :]
        row = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = row < N
        steps = K // BLOCK_K
        per_split = tl.cdiv(steps, SPLIT_K)
        first = tl.program_id(1) * per_split
        last = tl.minimum(first + per_split, steps)
        acc_low = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_high = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        x_sum = tl.zeros([64, BLOCK_M], dtype=tl.float32)
        for step in range(first, last):
            b = tl.load(w_ptr + step * step_bytes + at, mask=ok, other=0,
                        eviction_policy="evict_first")
            xt = tl.load(x_ptr + step * BLOCK_K + xt_at, mask=m_ok, other=0.0)
            if ASM:
                low, high = _nibbles_asm(b, False), _nibbles_asm(b, True)
            else:
                low, high = _nibbles_plain(b, False, xt.dtype), _nibbles_plain(b, True, xt.dtype)
            # [NA, KB, v_r, t1, t0, v8, v1] -> rows (an, v_r, t1), inputs (kt, v8, t0, v1)
            low = tl.permute(low.reshape(NA, KB, 2, 8, 4, 2, 2), (0, 2, 3, 1, 5, 4, 6))
            high = tl.permute(high.reshape(NA, KB, 2, 8, 4, 2, 2), (0, 2, 3, 1, 5, 4, 6))
            acc_low = tl.dot(low.reshape(BLOCK_N, BLOCK_K), xt, acc_low)
            acc_high = tl.dot(high.reshape(BLOCK_N, BLOCK_K), xt, acc_high)
            x_sum = tl.dot(tl.full([64, BLOCK_K], 1.0, xt.dtype), xt, x_sum)
        s = tl.load(s_ptr + row, mask=row_ok, other=0.0).to(tl.float32)
        y = (acc_high * 16.0 + acc_low
             - OFFSET_SUM * tl.max(x_sum, axis=0)[None, :]) * s[:, None]
        at_y = m[None, :] * N + row[:, None]
        store_ok = m_ok & row_ok[:, None]
        if SPLIT_K == 1:
            tl.store(y_ptr + at_y, y.to(y_ptr.dtype.element_ty), mask=store_ok)
        else:
            tl.atomic_add(space_ptr + at_y, y, mask=store_ok, sem="relaxed")
            if _last_share(count_ptr + tl.program_id(0), SPLIT_K):
                _collect(space_ptr + at_y, y_ptr + at_y, store_ok)

    return rows


def product(x2: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, *,
            launch: tuple[int, ...] | None = None,
            space: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x2 [M, K] @ (unpack(packed) * scales[:, None]).T: [M, N] in x2's dtype. Up to MOST_ROWS
    rows one block of rows, K in shares summed in `space` (a mslk_gemv.workspace(), a new one
    when left out); more in blocks of PROMPT_BLOCK_M rows, one program the whole K. `launch`
    (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) instead of DEFAULT or PROMPT_LAUNCH."""
    rows, k = x2.shape
    n = packed.shape[0]
    few = rows <= MOST_ROWS
    # bf16 on a GPU (the asm's numbers); fp16 too off one (Triton's interpreter, whose bf16
    # tl.dot is wrong)
    dtypes = (torch.bfloat16,) if x2.is_cuda else (torch.bfloat16, torch.float16)
    if (x2.dtype not in dtypes or packed.dtype != torch.int8 or packed.shape != (n, k)
            or scales.shape != (n,) or (few and space is not None and space[0].shape[0] < rows)):
        raise ValueError(f"int8 rows kernel: x {tuple(x2.shape)} {x2.dtype}, weight "
                         f"{tuple(packed.shape)} {packed.dtype}, scales {tuple(scales.shape)} "
                         f"do not fit")
    block_n, block_k, split_k, warps, stages = launch or (DEFAULT if few else PROMPT_LAUNCH)
    if n % 16 or k % block_k or block_k % 16 or block_n % 16:
        raise ValueError(f"int8 rows kernel: a {n}x{k} weight does not tile by {block_n} "
                         f"outputs and {block_k} inputs")
    # 8 warps: at least 32 rows, as mslk_rows (Triton's code for fewer faulted there)
    block_m = (max(mslk_rows.least_block_m(warps), 1 << (rows - 1).bit_length()) if few
               else PROMPT_BLOCK_M)
    split_k = min(split_k, k // block_k) if few else 1  # the shares' count is per output block
    x2 = x2.contiguous()
    y = torch.empty(rows, n, dtype=x2.dtype, device=x2.device)
    sums, counts = (space or mslk_gemv.workspace(rows, n, x2.device)) if split_k > 1 else (y, y)
    _kernel()[(-(-n // block_n), split_k, -(-rows // block_m))](
        x2, packed, scales, y, sums, counts, rows, n, k, x2.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
        OFFSET_SUM=float(OFFSET), ASM=x2.is_cuda, num_warps=warps, num_stages=stages)
    return y


@torch.library.custom_op("qwen_chat::int8_rows_product", mutates_args=())
def layer_product(x2: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                  sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """product() in a layer's workspace (`sums`, `counts`: left as they were found), as one op
    that torch.compile and CUDA graphs take whole."""
    return product(x2, packed, scales, space=(sums, counts))


@layer_product.register_fake
def _(x2, packed, scales, sums, counts):
    return x2.new_empty(x2.shape[0], packed.shape[0])
