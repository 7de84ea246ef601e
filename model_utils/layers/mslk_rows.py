"""A few rows times the int4 weights MSLK holds, through tensor cores with the weights as the
first operand: y.T [N, rows] = W [N, K] @ x.T [K, rows].

MSLK's atom (mslk_gemv's module doc) gives each thread of a warp the 8 nibbles of one 32-bit
word that a Hopper tensor-core instruction wants in that thread's registers when W is its first
operand: the word of lane 4 t1 + t0 holds rows t1 and t1 + 8 at inputs 2 t0, 2 t0 + 1, 2 t0 + 8
and 2 t0 + 9, nibble v_r + 2 v8 + 4 v1. Nibbles 0 and 4 sit at bits 0-3 and 16-19: one LOP3
instruction ((word & 0x000F000F) ^ MAGIC) makes the register holding the pair (row t1, inputs
2 t0 and 2 t0 + 1) as two bf16 numbers 128 + q (the nibble, XOR-ed with 8 to the app's q, is
the mantissa's low bits under 128.0's exponent), and so on for the other three pairs, shifted
by 4, 8 and 12 bits. A weight costs about a LOP3 and a quarter of a shift; the tensor core
multiplies, and another row adds no work per weight. (The mma-from-registers trick CUTLASS's
mixed-input GEMMs and Marlin use; Triton is told the same through an inline-asm conversion and
a reshape its layouts resolve within each thread's registers.)

The numbers: w = (q - 8) s + z in a group, so y = s Sum x (128 + q) + (z - 136 s) Sum x per
output and chunk of a group, the sums in fp32 (the products of bf16 x and 128 + q are exact).
Shares of the inputs (SPLIT_K) are summed in mslk_gemv's fp32 workspace, the last share's
program writing the output, as in mslk_gemv.

Off a GPU (Triton's interpreter, which runs no inline asm) the same numbers come from shifts
and masks; the rest of the kernel is the same.
"""

from __future__ import annotations

import functools

import torch

from . import mslk_gemv

# 128.0 in bf16 (0x4300) and 1024.0 in fp16 (0x6400) in both halves, with bit 3 of each half set
# so that the XOR turns MSLK's nibble (q ^ 8) back into q
MAGIC = {torch.bfloat16: (0x43084308, 136.0), torch.float16: (0x64086408, 1032.0)}


# the kernel's jitted helpers: Triton finds a kernel's callees among its globals
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
    def nibbles_asm(b, MAGIC_BITS: tl.constexpr):
        """A word's 4 bytes [..., 4] -> two tensors [..., 4] of x's dtype: the first holds
        nibbles 0, 4, 1, 5, the second 2, 6, 3, 7, each as 128 + q (1024 + q in fp16)."""
        return tl.inline_asm_elementwise(
            asm=f"""{{
            .reg .b32 t;
            lop3.b32 $0, $4, 0x000F000F, {MAGIC_BITS}, 0x6a;
            shr.b32 t, $4, 4;
            lop3.b32 $1, t, 0x000F000F, {MAGIC_BITS}, 0x6a;
            shr.b32 t, $4, 8;
            lop3.b32 $2, t, 0x000F000F, {MAGIC_BITS}, 0x6a;
            shr.b32 t, $4, 12;
            lop3.b32 $3, t, 0x000F000F, {MAGIC_BITS}, 0x6a;
            }}""",
            constraints="=r,=r,=r,=r,r", args=[b],
            dtype=(tl.bfloat16, tl.bfloat16) if MAGIC_BITS == 0x43084308
            else (tl.float16, tl.float16), is_pure=True, pack=4)

    @triton.jit
    def nibbles_plain(b, OFFSET: tl.constexpr, dtype: tl.constexpr):
        """nibbles_asm's numbers by shifts and masks (Triton's interpreter runs no asm), for
        b [NA, KB, 8, 4, 4]."""
        NA: tl.constexpr = b.shape[0]
        KB: tl.constexpr = b.shape[1]
        # byte 2 jh + jl of a word: jl = 0 (bytes 0 and 2: nibbles 0, 1 and 4, 5) makes the
        # first tensor, jl = 1 the second; in each, p = 2 v_r + v1 with v1 = jh
        even, odd = tl.split((b.to(tl.int32) & 0xFF).reshape(NA, KB, 8, 4, 2, 2))
        first = tl.permute(tl.join(even & 15, even >> 4) ^ 8, (0, 1, 2, 3, 5, 4))
        second = tl.permute(tl.join(odd & 15, odd >> 4) ^ 8, (0, 1, 2, 3, 5, 4))
        return ((first.reshape(NA, KB, 8, 4, 4).to(tl.float32) + (OFFSET - 8.0)).to(dtype),
                (second.reshape(NA, KB, 8, 4, 4).to(tl.float32) + (OFFSET - 8.0)).to(dtype))

    _nibbles_asm, _nibbles_plain = nibbles_asm, nibbles_plain
    _last_share, _collect = mslk_gemv._last_share, mslk_gemv._collect


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    _define_helpers()

    @triton.jit
    def rows(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, space_ptr, count_ptr, M, N, K, stride_xm,
             GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, CHUNK: tl.constexpr,
             MAGIC_BITS: tl.constexpr, OFFSET: tl.constexpr, ASM: tl.constexpr):
        NA: tl.constexpr = BLOCK_N // 16  # atoms along the outputs
        KB: tl.constexpr = BLOCK_K // 16  # and along the inputs, a step
        an = tl.program_id(0) * NA + tl.arange(0, NA)
        kt = tl.arange(0, KB)
        t1 = tl.arange(0, 8)
        t0 = tl.arange(0, 4)
        byte = tl.arange(0, 4)
        # the bytes of a step [NA, KB, 8, 4, 4]: atom (kt, an) starts at word
        # (kt * N/16 + an) * 32, its word 4 t1 + t0
        at = ((kt[None, :, None, None, None] * (N // 16) + an[:, None, None, None, None]) * 128
              + t1[None, None, :, None, None] * 16 + t0[None, None, None, :, None] * 4
              + byte[None, None, None, None, :])
        ok = (an * 16 < N)[:, None, None, None, None]
        step_bytes = KB * (N // 16) * 128
        m = tl.arange(0, BLOCK_M)
        xt_at = tl.arange(0, BLOCK_K)[:, None] + m[None, :] * stride_xm  # x.T [BLOCK_K, BLOCK_M]
        m_ok = (m < M)[None, :]
        row = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = row < N
        chunks = K // CHUNK
        per_split = tl.cdiv(chunks, SPLIT_K)
        first = tl.program_id(1) * per_split
        last = tl.minimum(first + per_split, chunks)
        y = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for chunk in range(first, last):
            group = chunk * CHUNK // GROUP
            # the group's scales and zero points asked for first, so that their latency can
            # pass under the chunk's products rather than follow them
            s = tl.load(s_ptr + group * N + row, mask=row_ok, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + group * N + row, mask=row_ok, other=0.0).to(tl.float32)
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            x_sum = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for step in tl.static_range(CHUNK // BLOCK_K):
                k0 = chunk * CHUNK + step * BLOCK_K
                b = tl.load(w_ptr + (k0 // BLOCK_K) * step_bytes + at, mask=ok, other=0,
                            eviction_policy="evict_first")
                xt = tl.load(x_ptr + k0 + xt_at, mask=m_ok, other=0.0)
                # Sum x (for the zero points) by the tensor cores too, a row of ones for each
                # output, so that the sums land in acc's layout: summing x in each thread (adds
                # and shuffles), or 64 rows of ones and a max over them (a reduction across
                # warps through shared memory, with barriers, every chunk) compiled to more
                # instructions
                x_sum = tl.dot(tl.full([BLOCK_N, BLOCK_K], 1.0, xt.dtype), xt, x_sum)
                if ASM:
                    r0, r1 = _nibbles_asm(b, MAGIC_BITS)
                else:
                    r0, r1 = _nibbles_plain(b, OFFSET, xt.dtype)
                # [NA, KB, t1, t0, p = 2 v_r + v1, v8] -> rows (an, v_r, t1), inputs
                # (kt, v8, t0, v1): both in their natural order
                w = tl.join(r0, r1).reshape(NA, KB, 8, 4, 2, 2, 2)
                w = tl.permute(w, (0, 4, 2, 1, 6, 3, 5)).reshape(BLOCK_N, BLOCK_K)
                acc = tl.dot(w, xt, acc)
            y += acc * s[:, None] + x_sum * (z - OFFSET * s)[:, None]
        at_y = m[None, :] * N + row[:, None]
        store_ok = m_ok & row_ok[:, None]
        if SPLIT_K == 1:
            tl.store(y_ptr + at_y, y.to(y_ptr.dtype.element_ty), mask=store_ok)
        else:
            tl.atomic_add(space_ptr + at_y, y, mask=store_ok, sem="relaxed")
            if _last_share(count_ptr + tl.program_id(0), SPLIT_K):
                _collect(space_ptr + at_y, y_ptr + at_y, store_ok)

    return rows


# Launches (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages), SPLIT_K 0 for a share a group;
# the fastest found per shape and row count by `benchmarks/int4_kernels.py --rows-search` lives
# in mslk_gemv's CONFIGS_FILE under "rows_kernel" ({rows: launch}), and up to how many rows this
# kernel beat MSLK's GEMM under "rows_kernel_rows". DEFAULT, for a shape not searched, is the
# tile every shape's search chose on an H100 (BENCHMARKS.md); the list searches around it too.
DEFAULT = (64, 64, 4, 4, 3)
SEARCHED = [(block_n, block_k, split_k, warps, 3)
            for block_n, warps in ((64, 4), (128, 4), (256, 8))
            for block_k in (64, 128) for split_k in (1, 4, 14)] + [
    (64, 64, split_k, 4, stages) for split_k in (1, 4, 14) for stages in (2, 4)] + [
    (64, 64, 2, 4, 3), (64, 64, 7, 4, 3),
    (128, 64, 2, 4, 3), (128, 64, 7, 4, 3), (256, 64, 2, 8, 3), (64, 128, 0, 4, 3),
    (128, 128, 0, 4, 3), (128, 64, 4, 4, 2), (128, 64, 4, 4, 4), (256, 64, 4, 8, 4)]


def config(n: int, k: int, rows: int, device: torch.device) -> tuple[int, ...]:
    found = mslk_gemv._shape_configs(torch.cuda.get_device_name(device), f"{n}x{k}")
    by_rows = found.get("rows_kernel", {})
    fitting = sorted(int(r) for r in by_rows if int(r) >= rows)
    return tuple(by_rows[str(fitting[0])]) if fitting else DEFAULT


def most_rows(n: int, k: int, device: torch.device) -> int:
    """Up to how many rows this kernel serves an [n, k] weight on this GPU (measured against
    MSLK's GEMM for the shape; 0, none, where the shape was not measured)."""
    found = mslk_gemv._shape_configs(torch.cuda.get_device_name(device), f"{n}x{k}")
    return int(found.get("rows_kernel_rows", 0))


def least_block_m(warps: int) -> int:
    """The fewest rows a launch of `warps` warps computes: 16, the tensor cores' least; 32 for
    8 warps, where at 16 Triton 3.6's code read past its shared buffer (an illegal address,
    found by compute-sanitizer on an H100; every 8-warp launch ran clean at 32)."""
    return 32 if warps > 4 else 16


def product(x2: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
            *, launch: tuple[int, ...] | None = None,
            space: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x2 [M, K] (M <= mslk_gemv.MOST_ROWS, bf16 or fp16) @ the weight [N, K/2] MSLK's copy
    holds (mslk_gemv.LAYOUT).T: [M, N] in x2's dtype; `launch` instead of config()'s, `space`
    a mslk_gemv.workspace() (a new one when left out)."""
    rows, k = x2.shape
    n, groups = weight.shape[0], scales.shape[0]
    if (rows > mslk_gemv.MOST_ROWS or x2.dtype not in MAGIC or weight.shape[1] * 2 != k
            or scales.shape != (groups, n) or zeros.shape != (groups, n) or k % groups
            or (space is not None and space[0].shape[0] < rows)):
        raise ValueError(f"MSLK rows kernel: x {tuple(x2.shape)} {x2.dtype}, weight "
                         f"{tuple(weight.shape)}, scales {tuple(scales.shape)}, zeros "
                         f"{tuple(zeros.shape)} do not fit")
    group = k // groups
    block_n, block_k, split_k, warps, stages = launch or config(n, k, rows, x2.device)
    block_k = min(block_k, group)
    if group % block_k or n % 16 or block_k % 16 or block_n % 16:
        raise ValueError(f"MSLK rows kernel: a {n}x{k} weight in groups of {group} does not "
                         f"tile by {block_n} outputs and {block_k} inputs")
    split_k = min(split_k or groups, groups)
    x2 = x2.contiguous()
    y = torch.empty(rows, n, dtype=x2.dtype, device=x2.device)
    sums, counts = space or mslk_gemv.workspace(rows, n, x2.device)
    magic, offset = MAGIC[x2.dtype]
    _kernel()[(-(-n // block_n), split_k)](
        x2, weight.view(torch.uint8), scales, zeros, y, sums, counts, rows, n, k, x2.stride(0),
        GROUP=group, BLOCK_M=max(least_block_m(warps), 1 << (rows - 1).bit_length()),
        BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, CHUNK=group, MAGIC_BITS=magic,
        OFFSET=offset, ASM=x2.is_cuda, num_warps=warps, num_stages=stages)
    return y
