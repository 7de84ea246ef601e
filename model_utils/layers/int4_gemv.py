"""One row times the int4 weights MSLK holds: a Triton GEMV over MSLK's own packed copy.

MSLK's CUTLASS GEMM (mslk_int4.py) is the fastest int4 product here from a few rows up and at
prefill, but at one row, a single reply's decode step, it was slower than gemlite's GEMV on
every linear shape of the 7B, slower than bf16 on two of them (BENCHMARKS.md, "int4-wo's
numbers through MSLK's CUTLASS kernel"). MSLK has no GEMV for these weights and gemlite's
cannot read MSLK's layout (its nibbles are unsigned), and two packed copies would double the
weights' memory: so this kernel reads MSLK's copy itself.

The layout (MSLK's `preshuffle_i4` for bf16 scales, checked against MSLK on the GPU by
tests/gpu/test_weight_kernels.py and at every load by mslk_int4.check): weights [N, K/2] int8,
read here as [N, K/8] int32 words of 8 nibbles; a nibble is q ^ 8 (q - 8 as 4-bit two's
complement) and a word's nibbles, lowest first, hold the inputs k = 0, 2, 4, 6, 1, 3, 5, 7 of
its 8 (`SHUFFLED`; MSLK's unshuffled layout, bf16i4bf16_rowwise's, holds 0..7). Scales and zero
points [K/group, N] bf16: w = (q - 8) * scale + zero, the app's numbers (int_quantization).

Each program computes BLOCK_N outputs over the whole of K, a group a step, in fp32:
y[n] = sum over groups of scale * sum((q - 8) * x) + zero * sum(x). No split of K, so no
atomics and the output is written once, in x's dtype.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

SHUFFLED_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the input each nibble of a shuffled word holds


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gemv(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, n_out, k_words, groups,
             GROUP: tl.constexpr, BLOCK_N: tl.constexpr, SHUFFLED: tl.constexpr):
        # One group a step: its scale and zero point are one number per output. The products
        # stay per (output, word) until the end, so that a step has no reduction across
        # threads; a word's 8 nibbles are taken apart in the thread that loaded it.
        words_per_group: tl.constexpr = GROUP // 8
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < n_out
        word = tl.arange(0, words_per_group)
        acc = tl.zeros([BLOCK_N, words_per_group], dtype=tl.float32)
        for g in range(0, groups):
            words = g * words_per_group + word
            w = tl.load(w_ptr + n[:, None] * k_words + words[None, :], mask=n_ok[:, None],
                        other=0)
            part = tl.zeros([BLOCK_N, words_per_group], dtype=tl.float32)
            x_sum = tl.zeros([words_per_group], dtype=tl.float32)
            for nibble in tl.static_range(8):
                if SHUFFLED:
                    k = (nibble % 4) * 2 + nibble // 4
                else:
                    k = nibble
                x = tl.load(x_ptr + words * 8 + k).to(tl.float32)
                q = ((((w >> (nibble * 4)) & 15) ^ 8) - 8).to(tl.float32)
                part += q * x[None, :]
                x_sum += x
            scale = tl.load(s_ptr + g * n_out + n, mask=n_ok, other=0.0).to(tl.float32)
            zero = tl.load(z_ptr + g * n_out + n, mask=n_ok, other=0.0).to(tl.float32)
            acc += part * scale[:, None] + zero[:, None] * x_sum[None, :]
        tl.store(y_ptr + n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=n_ok)

    return gemv


# (BLOCK_N, num_warps, num_stages): the fastest found per GPU and weight shape by
# `benchmarks/int4_kernels.py --gemv-search` (CONFIGS_FILE: {GPU name: {"NxK": [...]}}); a
# shape not searched takes DEFAULT_CONFIG. No tuning at load: a switch waits for none.
CONFIGS_FILE = Path(__file__).with_name("int4_gemv_configs.json")
DEFAULT_CONFIG = (16, 4, 3)
SEARCHED = [(block_n, warps, stages) for block_n in (8, 16, 32, 64)
            for warps, stages in ((2, 3), (4, 3), (4, 5))]


@functools.cache
def _configs(gpu: str) -> dict[str, list[int]]:
    found = json.loads(CONFIGS_FILE.read_text()) if CONFIGS_FILE.exists() else {}
    return found.get(gpu, {})


def config(n: int, k: int, device: torch.device) -> tuple[int, int, int]:
    return tuple(_configs(torch.cuda.get_device_name(device)).get(f"{n}x{k}", DEFAULT_CONFIG))


def gemv(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, *,
         shuffled: bool = True, launch: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [1, K] @ the int4 weight [N, K/2] (see module doc).T: [1, N] in x's dtype.
    `launch`: (BLOCK_N, num_warps, num_stages) instead of config()'s."""
    n, k = weight.shape[0], weight.shape[1] * 2
    groups = scales.shape[0]
    if x.shape != (1, k) or scales.shape != (groups, n) or zeros.shape != (groups, n):
        raise ValueError(f"int4 GEMV: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"scales {tuple(scales.shape)}, zeros {tuple(zeros.shape)} do not fit")
    if k % groups or (k // groups) % 8 or not weight.is_contiguous():
        raise ValueError("int4 GEMV: groups must be whole words of 8 and the weight contiguous")
    block_n, warps, stages = launch or config(n, k, x.device)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    grid = (-(-n // block_n),)
    _kernel()[grid](x.contiguous(), weight.view(torch.int32), scales.contiguous(),
                    zeros.contiguous(), y, n, k // 8, groups, GROUP=k // groups,
                    BLOCK_N=block_n, SHUFFLED=shuffled, num_warps=warps, num_stages=stages)
    return y


@torch.library.custom_op("qwen_chat::int4_gemv", mutates_args=())
def shuffled_gemv(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                  zeros: torch.Tensor) -> torch.Tensor:
    """gemv on the shuffled layout, as one op that torch.compile and CUDA graphs take whole."""
    return gemv(x, weight, scales, zeros)


@shuffled_gemv.register_fake
def _(x, weight, scales, zeros):
    return x.new_empty(1, weight.shape[0])


def shuffle_words(nibbles: torch.Tensor) -> torch.Tensor:
    """int8 [N, K/2] two nibbles a byte, input order (even k low) -> the shuffled layout's
    bytes: within each word of 8 nibbles, k = 0, 2, 4, 6 in the low half, 1, 3, 5, 7 in the
    high half (what MSLK's preshuffle_i4 does to bf16-scaled weights)."""
    b = nibbles.view(torch.uint8).reshape(nibbles.shape[0], -1, 4).to(torch.int32)
    low, high = b & 15, b >> 4
    out = torch.stack([low[..., 0] | low[..., 1] << 4, low[..., 2] | low[..., 3] << 4,
                       high[..., 0] | high[..., 1] << 4, high[..., 2] | high[..., 3] << 4], -1)
    return out.to(torch.uint8).view(torch.int8).reshape(nibbles.shape)
