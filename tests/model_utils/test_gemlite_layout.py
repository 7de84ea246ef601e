"""gemlite's int4 layout read back on the CPU (gemlite_weights.int4_weight): the weight a layer
packed for gemlite holds, for the prompt path that multiplies it through cuBLAS and for the
logprob checks. The packing is gemlite's pack_weights_over_cols, written out here (importing
gemlite asks for a GPU)."""

from __future__ import annotations

import torch

from model_utils.layers.gemlite_weights import int4_weight
from model_utils.layers.int_quantization import dequantize_int4, quantize_int4


def gemlite_words(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] in 0..15 as gemlite packs it for its kernels: [K/8, N] int32, element k of a
    row at bit 4 * (k % 8) of word k // 8 (the top nibble sets the sign bit)."""
    n, k = q.shape
    nibbles = q.to(torch.int64).reshape(n, k // 8, 8) << (4 * torch.arange(8))
    words = nibbles.sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).t().contiguous()


def test_the_layout_reads_back_to_the_weights_numbers():
    torch.manual_seed(0)
    weight = torch.randn(96, 512) * 0.02
    q, scales, zeros = quantize_int4(weight, 128)
    shifts = (zeros.float() - 8 * scales.float()).to(torch.bfloat16)  # as pack_int4 keeps them
    got = int4_weight(gemlite_words(q), scales.t(), shifts.t(), torch.float32)
    assert got.shape == (512, 96)
    expected = (q.float().reshape(96, 4, 128) * scales.float().unsqueeze(-1)
                + shifts.float().unsqueeze(-1)).reshape(96, 512)
    assert torch.equal(got.t(), expected)
    # the app's own form, (q - 8) * scale + zero, apart only by the shift's bf16 rounding
    reference = dequantize_int4(q, scales, zeros, torch.float32)
    step = scales.float().repeat_interleave(128, 1)
    assert ((got.t() - reference).abs() <= step / 16).all()


def test_a_misread_nibble_order_would_show():
    """Each of the eight nibbles of a word lands on its own row: reversing them moves rows."""
    q = torch.arange(16, dtype=torch.uint8).repeat(4, 8)[:, :128]  # 4 x 128, rows 0..15 cycling
    ones = torch.ones(1, 4, dtype=torch.bfloat16)
    got = int4_weight(gemlite_words(q), ones, torch.zeros_like(ones), torch.float32)
    assert torch.equal(got.t(), q.float())
