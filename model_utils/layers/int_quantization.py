"""The numbers of the app's weight-only modes: int4 and int8 weights rounded from bf16, and
back (the scheme and why: weight_only's doc). Plain tensors in, plain tensors out; the layers
that keep and multiply them are in weight_only."""

from __future__ import annotations

import torch

# Each group's range is searched among these fractions of its own (shrunk about its middle):
# clipping a group's few outermost weights makes the step finer for all the others. The
# fraction with the least squared error over the group is kept; no calibration data is needed.
INT4_RANGE_FRACTIONS = (1.0, 0.9, 0.85, 0.8)
QUANTIZE_ROWS = 2048  # rows quantized at once: the search's fp32 temporaries stay small


def quantize_int4(weight: torch.Tensor, group: int):
    """(q uint8 [N, K] in 0..15, scales bf16 [N, K/group], zeros bf16 [N, K/group]).

    Computed in fp32, then q is taken against the bf16-rounded scale and zero that are stored,
    so that dequantizing from what is stored is exact to what the kernels read."""
    parts = [_quantize_int4_rows(rows, group) for rows in weight.detach().split(QUANTIZE_ROWS)]
    return tuple(torch.cat(tensors) for tensors in zip(*parts))


def _quantize_int4_rows(weight: torch.Tensor, group: int):
    n, k = weight.shape
    w = weight.float().reshape(n, k // group, group)
    low, high = w.amin(-1), w.amax(-1)
    middle, half = (high + low) / 2, (high - low) / 2
    best = None  # (squared error, scales, zeros) per group
    x = torch.empty_like(w)
    for fraction in INT4_RANGE_FRACTIONS:
        scales, zeros = _int4_range(middle - fraction * half, middle + fraction * half)
        s = scales.float().unsqueeze(-1)
        # The weights in steps of the grid (in place: a load quantizes billions of them), and
        # their distance to the level they round to, in weight units squared.
        torch.sub(w, zeros.float().unsqueeze(-1) - 8 * s, out=x).div_(s)
        error = x.round().clamp_(0, 15).sub_(x).square_().sum(-1) * s.squeeze(-1).square()
        if best is None:
            best = (error, scales, zeros)
            continue
        better = error < best[0]
        best = (torch.where(better, error, best[0]), torch.where(better, scales, best[1]),
                 torch.where(better, zeros, best[2]))
    _, scales, zeros = best
    s = scales.float().unsqueeze(-1)
    q = torch.sub(w, zeros.float().unsqueeze(-1) - 8 * s, out=x).div_(s).round_().clamp_(0, 15)
    return q.to(torch.uint8).reshape(n, k), scales, zeros


def _int4_range(low: torch.Tensor, high: torch.Tensor):
    """The stored (bf16) scale and zero point of 16 levels from `low` to `high`."""
    scales = ((high - low) / 15).clamp(min=torch.finfo(torch.bfloat16).smallest_normal)
    return scales.to(torch.bfloat16), (low + 8 * scales).to(torch.bfloat16)


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    n, k = q.shape
    groups = scales.shape[1]
    w = (q.reshape(n, groups, k // groups).to(dtype) - 8) * scales.to(dtype).unsqueeze(-1) \
        + zeros.to(dtype).unsqueeze(-1)
    return w.reshape(n, k)


def quantize_int8(weight: torch.Tensor):
    """(q int8 [N, K] in -127..127, scales bf16 [N])."""
    w = weight.detach().float()
    scales = (w.abs().amax(-1) / 127).clamp(min=torch.finfo(torch.bfloat16).smallest_normal)
    scales = scales.to(torch.bfloat16)
    q = torch.clamp(torch.round(w / scales.float().unsqueeze(-1)), -127, 127).to(torch.int8)
    return q, scales


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> [N, K/2] bytes, even columns in the high nibble (tinygemm's input)."""
    return (q[:, ::2] << 4 | q[:, 1::2]).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed >> 4, packed & 15], dim=-1).reshape(packed.shape[0], -1)
