"""A sketch, not used by the app: int8-wo's weights ([N, K] int8, a bf16 scale per output) times
a few rows through tensor cores with the weights as the first operand, as
model_utils/layers/mslk_rows.py does for int4. Here, no GPU needed:

    python benchmarks/cpu-2026-12-07/int8_rows_sketch.py           # compiled for a Hopper GPU
    TRITON_INTERPRET=1 python benchmarks/cpu-2026-12-07/int8_rows_sketch.py --check  # numbers

What it found (int8-rows-sketch.log): the numbers are right (the interpreter, against the
dequantized product) and the weights reach the wgmma with no layout conversion, but at 9.8-10.1
instructions a weight, most of them PRMTs, address arithmetic and byte loads: in the [N, K]
layout a thread's four values (inputs 2 t0, 2 t0 + 1, 2 t0 + 8, 2 t0 + 9 of a row) lie in two
places, so they are loaded in pieces and assembled. A copy kept in the fragment's order (each
thread's four bytes in one word, as MSLK's atom does for int4; mslk_rows: 3.3-4.1 a weight)
would take one load a word, but the prompts' path and gemlite read the [N, K] copy: that is a
change of int8-wo's layout for every row count. model_utils/layers/int8_rows.py keeps that order
(4.2-5.0 instructions a weight, int8-rows-compiled.log), as the int8-wo-rows candidate.

How it computes: bf16 holds 128 + u exactly for a 4-bit u, not for a byte, so each weight q
(-127..127) is split in two numbers the tensor cores take: q = 16 h + l with h = q >> 4 (-8..7)
and l = q & 15. A thread's four bytes are put in the order 0, 2, 1, 3 by one PRMT, after which
one LOP3 makes the register of two bf16 numbers 128 + l for inputs 2 t0 and 2 t0 + 1, another
(XOR-ing 8 into the high nibble) 136 + h, and the same for the other pair shifted by 8 bits; a
product is two: Sum x q = 16 Sum x (136 + h) + Sum x (128 + l) - 2304 Sum x, times the row's
scale at the end (Sum x by the tensor cores from a tile of ones).
"""

import argparse
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from model_utils.layers import mslk_gemv  # noqa: E402

# 136 Sum x h + 128 Sum x l: the offsets the two numbers carry, summed over q = 16 h + l
OFFSET = 16 * 136 + 128

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
    def nibbles_asm(b):
        """A thread's bytes [..., 4] (inputs 2 t0, 2 t0 + 1, 2 t0 + 8, 2 t0 + 9) -> two bf16
        tensors [..., 4]: the first 128 + l, 128 + l, 136 + h, 136 + h of the first two inputs,
        the second the same of the last two."""
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 d, t;
            prmt.b32 d, $4, 0, 0x3120;
            lop3.b32 $0, d, 0x000F000F, 0x43004300, 0xea;
            shr.b32 t, d, 4;
            lop3.b32 $1, t, 0x000F000F, 0x43084308, 0x6a;
            shr.b32 t, d, 8;
            lop3.b32 $2, t, 0x000F000F, 0x43004300, 0xea;
            shr.b32 t, d, 12;
            lop3.b32 $3, t, 0x000F000F, 0x43084308, 0x6a;
            }""",
            constraints="=r,=r,=r,=r,r", args=[b], dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True, pack=4)

    @triton.jit
    def nibbles_plain(b, dtype: tl.constexpr):
        """nibbles_asm's numbers by shifts and masks (Triton's interpreter runs no asm), for
        b [BLOCK_N, KB, 4, 4]."""
        BN: tl.constexpr = b.shape[0]
        KB: tl.constexpr = b.shape[1]
        u = b.to(tl.int32) & 0xFF
        low = (u & 15).to(tl.float32) + 128.0
        high = ((u >> 4) ^ 8).to(tl.float32) + 128.0
        # [BN, KB, t0, byte = 2 v8 + v1] -> [.., v8, part, v1]: part 0 low, 1 high
        both = tl.join(low, high).reshape(BN, KB, 4, 2, 2, 2)  # .., v8, v1, part
        both = tl.permute(both, (0, 1, 2, 3, 5, 4)).reshape(BN, KB, 4, 2, 4)
        first, second = tl.split(tl.permute(both, (0, 1, 2, 4, 3)))  # v8 split off
        return first.to(dtype), second.to(dtype)

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
        KB: tl.constexpr = BLOCK_K // 16
        row = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = row < N
        kt = tl.arange(0, KB)
        t0 = tl.arange(0, 4)
        byte = tl.arange(0, 4)  # 2 v8 + v1: inputs 16 kt + 2 t0 + v1 + 8 v8
        at = (row[:, None, None, None] * K + kt[None, :, None, None] * 16
              + t0[None, None, :, None] * 2 + (byte % 2)[None, None, None, :]
              + (byte // 2)[None, None, None, :] * 8)  # [BLOCK_N, KB, 4, 4]
        ok = row_ok[:, None, None, None]
        m = tl.arange(0, BLOCK_M)
        xt_at = tl.arange(0, BLOCK_K)[:, None] + m[None, :] * stride_xm
        m_ok = (m < M)[None, :]
        steps = K // BLOCK_K
        per_split = tl.cdiv(steps, SPLIT_K)
        first = tl.program_id(1) * per_split
        last = tl.minimum(first + per_split, steps)
        acc_low = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_high = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        x_sum = tl.zeros([64, BLOCK_M], dtype=tl.float32)
        for step in range(first, last):
            k0 = step * BLOCK_K
            b = tl.load(w_ptr + k0 + at, mask=ok, other=0, eviction_policy="evict_first")
            xt = tl.load(x_ptr + k0 + xt_at, mask=m_ok, other=0.0)
            if ASM:
                r0, r1 = _nibbles_asm(b)
            else:
                r0, r1 = _nibbles_plain(b, xt.dtype)
            # [BLOCK_N, KB, t0, p = 2 part + v1, v8] -> part split off, inputs (kt, v8, t0, v1)
            w = tl.join(r0, r1).reshape(BLOCK_N, KB, 4, 2, 2, 2)  # .., t0, part, v1, v8
            w = tl.permute(w, (0, 1, 5, 2, 4, 3))  # .., v8, t0, v1, part
            low, high = tl.split(w)
            acc_low = tl.dot(low.reshape(BLOCK_N, BLOCK_K), xt, acc_low)
            acc_high = tl.dot(high.reshape(BLOCK_N, BLOCK_K), xt, acc_high)
            x_sum = tl.dot(tl.full([64, BLOCK_K], 1.0, xt.dtype), xt, x_sum)
        s = tl.load(s_ptr + row, mask=row_ok, other=0.0).to(tl.float32)
        y = (acc_high * 16.0 + acc_low - OFFSET_SUM * tl.max(x_sum, axis=0)[None, :]) * s[:, None]
        at_y = m[None, :] * N + row[:, None]
        store_ok = m_ok & row_ok[:, None]
        if SPLIT_K == 1:
            tl.store(y_ptr + at_y, y.to(y_ptr.dtype.element_ty), mask=store_ok)
        else:
            tl.atomic_add(space_ptr + at_y, y, mask=store_ok, sem="relaxed")
            if _last_share(count_ptr + tl.program_id(0), SPLIT_K):
                _collect(space_ptr + at_y, y_ptr + at_y, store_ok)

    return rows


DEFAULT = (128, 64, 4, 4, 3)

def product(x2: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, *,
            launch: tuple[int, ...] | None = None,
            space: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x2 [M, K] bf16 (M <= mslk_gemv.MOST_ROWS) @ (weight [N, K] int8 * scales [N]).T:
    [M, N] in x2's dtype; `launch` instead of DEFAULT; `space` a mslk_gemv.workspace() (a new one when left out)."""
    rows, k = x2.shape
    n = weight.shape[0]
    block_n, block_k, split_k, warps, stages = launch or DEFAULT
    # bf16 on a GPU (the asm's numbers); fp16 too off one (Triton's interpreter, whose bf16
    # tl.dot is wrong)
    dtypes = (torch.bfloat16,) if x2.is_cuda else (torch.bfloat16, torch.float16)
    if (rows > mslk_gemv.MOST_ROWS or x2.dtype not in dtypes or weight.dtype != torch.int8
            or weight.shape != (n, k) or scales.shape != (n,)
            or (space is not None and space[0].shape[0] < rows)):
        raise ValueError(f"int8 rows kernel: x {tuple(x2.shape)} {x2.dtype}, weight "
                         f"{tuple(weight.shape)} {weight.dtype}, scales {tuple(scales.shape)} "
                         f"do not fit")
    if k % block_k or block_k % 16 or block_n % 16:
        raise ValueError(f"int8 rows kernel: a {n}x{k} weight does not tile by {block_n} "
                         f"outputs and {block_k} inputs")
    split_k = min(split_k, k // block_k)
    x2, weight = x2.contiguous(), weight.contiguous()
    y = torch.empty(rows, n, dtype=x2.dtype, device=x2.device)
    sums, counts = space or mslk_gemv.workspace(rows, n, x2.device)
    _kernel()[(-(-n // block_n), split_k)](
        x2, weight, scales, y, sums, counts, rows, n, k, x2.stride(0),
        BLOCK_M=max(16, 1 << (rows - 1).bit_length()), BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT_K=split_k, OFFSET_SUM=float(OFFSET), ASM=x2.is_cuda, num_warps=warps,
        num_stages=stages)
    return y


CASES = [  # (outputs, inputs, rows, launch); fp16 x (the interpreter's bf16 tl.dot is wrong)
    (64, 256, 3, (64, 64, 1, 4, 2)), (48, 384, 8, (32, 64, 3, 4, 2)),
    (32, 256, 20, (32, 32, 2, 4, 2))]


def check() -> None:
    """The interpreter's product against x @ the dequantized weight (TRITON_INTERPRET=1)."""
    sys.path.insert(0, str(ROOT / "tests" / "model_utils"))
    from triton_interpreter import patch_interpreter

    from model_utils.layers.int_quantization import quantize_int8
    patch_interpreter()
    for n, k, rows, launch in CASES:
        generator = torch.Generator().manual_seed(n + rows)
        q, scales = quantize_int8(torch.randn(n, k, generator=generator))
        x2 = torch.randn(rows, k, generator=generator).half()
        expected = x2.float() @ (q.float() * scales.float()[:, None]).T
        y = product(x2, q, scales.half(), launch=launch)
        print(f"{n}x{k}, {rows} rows: relative error "
              f"{((y.float() - expected).norm() / expected.norm()).item():.1e}")


def counts(rows: int, block_n: int, block_k: int, split_k: int, warps: int) -> dict:
    """Compiled for a Hopper GPU: benchmarks/gemv_compiled.py's counts for this kernel (a loop
    iteration is one step of BLOCK_K inputs)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gemv_compiled import report

    return report(rows, block_n, block_k, split_k, warps, chunk=block_k, swapped="int8",
                  stages=3, int8_kernel=_kernel())


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true")
    if parser.parse_args().check:
        check()
    else:
        for launch in ((8, 128, 64, 4, 4), (8, 256, 64, 4, 8), (32, 128, 64, 4, 4),
                       (32, 256, 128, 4, 8)):
            print(counts(*launch), flush=True)
