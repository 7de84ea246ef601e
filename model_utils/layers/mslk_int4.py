"""MSLK's CUTLASS mixed-input GEMM for the app's int4 weights on a Hopper GPU.

MSLK (pip `mslk-cuda`, PyTorch's kernel library formerly FBGEMM's gen_ai kernels: prebuilt, no
compiling at install) multiplies bf16 rows by int4 weights with bf16 group scales and zero
points, w = q_signed * scale + zero with q_signed = q - 8: the app's own numbers
(int_quantization), so they are repacked, not rounded again. Its `bf16i4bf16_shuffled` reads
the weights pre-shuffled once at load into the order its Hopper tensor-core kernel loads them,
and it serves every row count from one copy, a decode step's few rows and a prompt's thousand.
Its kernel is chosen by a fixed heuristic, not tuned at a shape's first use as gemlite's Triton
kernels are: nothing to ship or wait for at a load. Its tiles are made for many rows: for a
decode step's few (up to gemv_rows), mslk_gemv's Triton GEMV reads the same copy instead, and
for a few more (up to tensor_core_rows) mslk_rows' tensor-core kernel, where the layout
mslk_layout reads off MSLK's preshuffle (once per process) is the one they read.
Measured faster than gemlite's kernels at every load (BENCHMARKS.md, "The GEMV timed"), so
weight_only.int4_kernel picks it first wherever it loads.

Imported lazily (mslk loads its CUDA library at import). The wheel on PyPI (1.1.0) is built
against torch 2.11 and CUDA 13: under another torch its import fails, and unavailable_reason
says so.
"""

from __future__ import annotations

import functools
import logging

import torch

from . import mslk_gemv, mslk_layout, mslk_rows

log = logging.getLogger(__name__)

OP = "bf16i4bf16_shuffled"


def unavailable_reason(device: torch.device, compute_dtype: torch.dtype) -> str | None:
    """Why MSLK's int4 kernel cannot serve int4 layers here, or None when it can."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "MSLK's int4 kernel is for CUDA GPUs"
    if compute_dtype != torch.bfloat16:
        return f"MSLK's int4 kernel takes bf16 inputs, not {compute_dtype}"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return "MSLK's int4 kernel is built for Hopper GPUs (compute capability 9.0)"
    return _import_problem()


@functools.cache
def _import_problem() -> str | None:
    try:
        import mslk  # noqa: F401 - registers torch.ops.mslk
        if not hasattr(torch.ops.mslk, OP):
            return f"this mslk has no {OP}"
        _give_fake_kernel()
    except Exception as error:  # noqa: BLE001 - not installed, or built for another torch
        return f"mslk is not available ({type(error).__name__}: {error})"
    return None


def _give_fake_kernel() -> None:
    """The op's output shape for torch.compile's tracing, where MSLK registers none (the
    argument names are its schema's)."""
    name = f"mslk::{OP}"
    if not torch._C._dispatch_has_kernel_for_dispatch_key(name, "Meta"):
        torch.library.register_fake(name)(
            lambda X, W, w_scale_group, w_zero_group: X.new_empty(X.shape[0], W.shape[0]))  # noqa: N803


def pack(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor):
    """The app's int4 numbers (q uint8 [N, K] in 0..15; bf16 scales and zeros [N, K/group])
    as the kernel reads them: (weight int8 [N, K/2], scales, zeros [K/group, N]). Each byte
    holds two signed nibbles (q - 8, that is q ^ 8), the even column low, then shuffled."""
    if (problem := unavailable_reason(q.device, torch.bfloat16)) is not None:
        raise RuntimeError(problem)
    packed, scales = torch.ops.mslk.preshuffle_i4(signed_nibbles(q), scales.t().contiguous())
    return packed, scales, zeros.t().contiguous()


def signed_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] in 0..15 -> int8 [N, K/2]: q - 8 as 4-bit two's complement (q ^ 8), the
    even column in the low nibble (MSLK's pack_int4)."""
    nibbles = q ^ 8
    return (nibbles[:, ::2] | (nibbles[:, 1::2] << 4)).contiguous().view(torch.int8)


@torch.library.custom_op("qwen_chat::mslk_int4_product", mutates_args=())
def product(x2: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
            gemv_rows: int = 0, sums: torch.Tensor | None = None,
            counts: torch.Tensor | None = None, tensor_core_rows: int = 0) -> torch.Tensor:
    """x2 [M, K] bf16 @ the dequantized weight.T: [M, N] bf16; up to `gemv_rows` rows (of
    gemv_rows(), for the weight's shape and device) through mslk_gemv, then up to
    `tensor_core_rows` (tensor_core_rows()) through mslk_rows, in the layer's workspace
    (`sums`, `counts`: left as they were found), more through MSLK's GEMM. One op, the choice
    made inside: traced, a choice by the row count is a guard on it, and a step compiled for
    any row count from two was compiled again for each range of rows the crossovers cut."""
    space = None if sums is None or counts is None else (sums, counts)
    if x2.shape[0] <= gemv_rows:
        return mslk_gemv.gemv(x2, weight, scales, zeros, space=space)
    if x2.shape[0] <= tensor_core_rows:
        return mslk_rows.product(x2, weight, scales, zeros, space=space)
    return torch.ops.mslk.bf16i4bf16_shuffled(x2, weight, scales, zeros)


@product.register_fake
def _(x2, weight, scales, zeros, gemv_rows=0, sums=None, counts=None, tensor_core_rows=0):
    return x2.new_empty(x2.shape[0], weight.shape[0])


def keep_gemv(layer, packed: torch.Tensor) -> None:
    """The rows the layer's GEMV and its tensor-core kernel serve (layer.mslk_gemv_rows,
    layer.mslk_tensor_core_rows) and, if any, their workspace."""
    layer.mslk_gemv_rows = gemv_rows(packed)
    layer.mslk_tensor_core_rows = tensor_core_rows(packed)
    if served := max(layer.mslk_gemv_rows, layer.mslk_tensor_core_rows):
        sums, counts = mslk_gemv.workspace(served, packed.shape[0], packed.device)
        layer.register_buffer("mslk_gemv_sums", sums, persistent=False)
        layer.register_buffer("mslk_gemv_counts", counts, persistent=False)


def layer_product(layer, x2: torch.Tensor) -> torch.Tensor:
    """product() with the layer's copy, its kernels' rows and workspace (keep_gemv)."""
    return product(x2, layer.packed, layer.mslk_scales, layer.mslk_zeros, layer.mslk_gemv_rows,
                   getattr(layer, "mslk_gemv_sums", None),
                   getattr(layer, "mslk_gemv_counts", None),
                   getattr(layer, "mslk_tensor_core_rows", 0))


def gemv_rows(weight: torch.Tensor) -> int:
    """Up to how many rows mslk_gemv multiplies MSLK's copy `weight` [N, K/2]: its measured
    crossover with MSLK's GEMM for the shape (mslk_gemv.most_rows), 0 where it cannot read
    MSLK's layout on this device."""
    if not gemv_reads_layout(weight.device):
        return 0
    return mslk_gemv.most_rows(weight.shape[0], weight.shape[1] * 2, weight.device)


def tensor_core_rows(weight: torch.Tensor) -> int:
    """Up to how many rows mslk_rows multiplies MSLK's copy `weight` (its measured crossover
    with MSLK's GEMM, mslk_rows.most_rows; 0 where unmeasured or the layout is not its)."""
    if not gemv_reads_layout(weight.device):
        return 0
    return mslk_rows.most_rows(weight.shape[0], weight.shape[1] * 2, weight.device)


@functools.cache
def gemv_reads_layout(device: torch.device) -> bool:
    """Whether MSLK's shuffled layout on this device, read off its preshuffle, is the one
    mslk_gemv reads; if not, MSLK's GEMM serves every row count (said once in the log)."""
    def preshuffle(q, scales):
        return torch.ops.mslk.preshuffle_i4(signed_nibbles(q), scales)[0]

    try:
        read = mslk_layout.read(preshuffle, device)
    except Exception as error:  # noqa: BLE001 - unreadable, or the probe refused: no GEMV
        log.warning("MSLK's int4 layout could not be read (%s): its GEMM serves every row "
                    "count", error)
        return False
    shape = (mslk_layout.PROBE_N, mslk_layout.PROBE_K)
    if not torch.equal(read.positions(*shape), mslk_gemv.LAYOUT.positions(*shape)):
        log.warning("MSLK's int4 layout here (%dx%d atoms) is not the one the GEMV reads: "
                    "MSLK's GEMM serves every row count", read.atom_n, read.atom_k)
        return False
    return True


# Input features read back at once: the identity's rows (bf16) and their product stay small.
READ_BACK_ROWS = 2048


def dequantized(weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """The [N, K] weight the shuffled layout holds, read through the kernel itself: the
    identity's product is each weight once, as the kernel dequantizes it (the layout's order
    is MSLK's own, not a documented format to unpack by hand). READ_BACK_ROWS input features
    at a time."""
    n, k = weight.shape[0], weight.shape[1] * 2
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    for first in range(0, k, READ_BACK_ROWS):
        rows = min(READ_BACK_ROWS, k - first)
        identity = torch.zeros(rows, k, dtype=torch.bfloat16, device=weight.device)
        steps = torch.arange(rows, device=weight.device)
        identity[steps, first + steps] = 1
        out[:, first:first + rows] = product(identity, weight, scales, zeros).t()
    return out


# Row counts a shape's first layer is checked at, at load: rows the GEMV may serve (1, 2, 4, 8,
# 16, 32: each a searched launch), then one in each band of rows that MSLK gives its own tile
# (its choice goes by the row count and the output width: up to 16, 32, 64, 128, 256, 512, 1024
# rows, and beyond).
CHECKED_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


def check(layer, weight_rows) -> None:
    """Run the layer's product at CHECKED_ROWS once and hold it to the weights' own numbers
    (`weight_rows`: the dequantized weight at some output features, from the numbers before
    packing); raises what the kernel raised or gemlite_checks.WrongProduct."""
    from .gemlite_checks import checked_outputs, off_product

    device = layer.packed.device
    outputs = checked_outputs(layer.out_features, device)
    with torch.inference_mode():
        weight = weight_rows(outputs).float()
        for rows in CHECKED_ROWS:
            x2 = torch.randn(rows, layer.in_features, dtype=torch.bfloat16, device=device,
                             generator=torch.Generator(device=device).manual_seed(rows))
            got = layer_product(layer, x2)
            if (failure := off_product(got[:, outputs].float(), x2.float() @ weight.T)):
                raise failure
