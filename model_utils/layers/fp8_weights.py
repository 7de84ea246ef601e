"""fp8 (e4m3) weights with one scale per output row, quantized by the app at load.

The 8-bit mode for GPUs with fp8 tensor cores (compute capability 8.9 and up: Ada, Hopper,
Blackwell). The weight is stored once, as e4m3 with an fp32 scale per row: w = q * scale, q in
+-448. The forward quantizes its input the same way, one scale per token (dynamic, taken from
the token's own largest value), and multiplies in fp8 with torch._scaled_mm, which applies both
scales to the fp32 accumulator: the scheme vLLM and torchao call fp8 rowwise. Every row count
(decode, batches, prefill) reads the one fp8 copy; no bf16 copy of a weight is kept.

Rows below `scaled_mm_from_rows` (64: every decode batch) take the weight-only product
instead: x stays in bf16 and is multiplied by the fp8 weights, then by the row scales. On a GPU
with gemlite installed that is gemlite's fp8 GEMV / split-K kernel on the same weight tensor
(gemlite_weights); elsewhere linear(x, q.to(dtype)) * scale (what inductor compiles into one
reduction over the fp8 weights; uncompiled, on the CPU, it converts the layer's weight for the
call). Weight-only decode rows also lose less: rounding every input
token to e4m3 was most of this mode's error against fp32 (BENCHMARKS.md, "CPU figures").

torch._scaled_mm also runs on the CPU (torch 2.13), so the CPU computes the same numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import gemlite_weights

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# torch._scaled_mm wants both matrix sizes of the weight in multiples of 16.
SCALED_MM_MULTIPLE = 16
# Inputs of fewer rows take the weight-only product (module doc); the gemlite kernels' limit.
SCALED_MM_FROM_ROWS = gemlite_weights.GEMLITE_BELOW_ROWS
# Compute capability of the first GPUs with fp8 tensor cores (Ada).
MIN_CAPABILITY = (8, 9)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [N, K], scales float32 [N]): w ~= q * scale, row by row."""
    w = weight.detach().float()
    scales = (w.abs().amax(-1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (w / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scales


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An input [M, K] as e4m3 with one fp32 scale per row ([M, 1]), for torch._scaled_mm."""
    x = x.float()
    scales = (x.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    # _scaled_mm's first matrix must be row-major; a reshaped input need not be.
    return (x / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8).contiguous(), scales


def fits(linear: nn.Linear) -> bool:
    return (linear.in_features % SCALED_MM_MULTIPLE == 0
            and linear.out_features % SCALED_MM_MULTIPLE == 0)


def unavailable_reason(device: str) -> str | None:
    """Why fp8 weights cannot run on this kind of device ("cpu" or "cuda"), or None."""
    if device != "cuda" or not torch.cuda.is_available():
        return None
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY:
        return (f"fp8 needs a GPU with fp8 tensor cores (compute capability "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer: Ada, Hopper); this one is "
                f"{capability[0]}.{capability[1]}: pick int8-wo or bf16")
    return None


class Fp8Linear(nn.Module):
    """A Linear whose weight is e4m3 with one scale per output row (see module doc)."""

    gemlite_meta = None  # set by gemlite_weights.attach on a GPU with gemlite

    def __init__(self, linear: nn.Linear, *, scaled_mm_from_rows: int = SCALED_MM_FROM_ROWS):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scales = quantize_fp8(linear.weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales)
        self.bias = linear.bias
        self.scaled_mm_from_rows = scaled_mm_from_rows

    def gemlite_weight(self) -> torch.Tensor:
        return self.qweight.t()  # [K, N]: gemlite reads the app's layout through a view

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if gemlite_weights.takes(self, x2):
            y = gemlite_weights.product(self, x2)
        elif x2.shape[0] < self.scaled_mm_from_rows:  # a static shape: decided at capture
            y = F.linear(x2, self.qweight.to(x.dtype)) * self.scales.to(x.dtype)
        else:
            xq, x_scales = quantize_rows(x2)
            # qweight.t() is the column-major [K, N] operand _scaled_mm's second matrix needs.
            # Row-wise scales need a bf16 output on CUDA; other compute dtypes convert after.
            y = torch._scaled_mm(xq, self.qweight.t(), scale_a=x_scales,
                                 scale_b=self.scales.unsqueeze(0),
                                 out_dtype=torch.bfloat16).to(x.dtype)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.qweight.float() * self.scales.unsqueeze(-1)).to(dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"scaled_mm_from_rows={self.scaled_mm_from_rows}")
