"""int4_gemv's Triton kernel on the CPU, through Triton's interpreter: one row times int4
weights in MSLK's shuffled layout (and the plain one), against the app's dequantized weight.
The layout itself is held to MSLK's on a GPU (tests/gpu/test_weight_kernels.py)."""

from __future__ import annotations

import pytest
import torch

from model_utils.layers import int4_gemv, mslk_int4
from model_utils.layers.int_quantization import dequantize_int4, quantize_int4

from .triton_interpreter import patch_interpreter, run_interpreted

pytestmark = pytest.mark.unit

# (outputs, inputs, group, (BLOCK_N, num_warps, num_stages), x dtype)
CASES = [
    (40, 256, 64, (16, 4, 2), torch.float32),  # outputs not a multiple of the block
    (37, 384, 128, (8, 2, 3), torch.float16),
    (64, 512, 32, (32, 4, 4), torch.bfloat16),
]


def check_cases() -> None:
    patch_interpreter()
    for n, k, group, launch, dtype in CASES:
        generator = torch.Generator().manual_seed(n)
        q, scales, zeros = quantize_int4(torch.randn(n, k, generator=generator), group)
        x = torch.randn(1, k, generator=generator).to(dtype)
        expected = x.float() @ dequantize_int4(q, scales, zeros, torch.float32).T
        nibbles = mslk_int4.signed_nibbles(q)
        for layout, weight in (("shuffled", int4_gemv.shuffle_words(nibbles)),
                               ("plain", nibbles)):
            y = int4_gemv.gemv(x, weight, scales.t().contiguous(), zeros.t().contiguous(),
                               shuffled=layout == "shuffled", launch=launch)
            assert y.dtype == dtype and y.shape == (1, n)
            error = ((y.float() - expected).norm() / expected.norm()).item()
            assert error < {torch.float32: 1e-5}.get(dtype, 5e-3), (n, k, layout, dtype, error)
            print(f"{n}x{k} group {group} {layout} {dtype}: relative error {error:.1e}")
        # The order matters: the plain layout read as shuffled is another product.
        wrong = int4_gemv.gemv(x, nibbles, scales.t().contiguous(), zeros.t().contiguous(),
                               shuffled=True, launch=launch)
        assert ((wrong.float() - expected).norm() / expected.norm()).item() > 0.1


def test_the_gemv_kernel_computes_the_dequantized_product():
    pytest.importorskip("triton")
    done = run_interpreted("tests.model_utils.test_int4_gemv", "check_cases")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("relative error") == 2 * len(CASES), done.stdout


def test_shuffle_words_puts_even_inputs_in_the_low_half_of_each_word():
    q = torch.arange(16, dtype=torch.uint8).repeat(2, 1)  # inputs 0..15 hold their own index
    words = int4_gemv.shuffle_words(mslk_int4.signed_nibbles(q)).view(torch.int32)
    nibbles = [[((int(w) >> 4 * p) & 15) ^ 8 for p in range(8)] for w in words[0]]
    assert nibbles == [[0, 2, 4, 6, 1, 3, 5, 7], [8, 10, 12, 14, 9, 11, 13, 15]]


def test_shapes_that_do_not_fit_are_refused_plainly():
    weight = torch.zeros(8, 64, dtype=torch.int8)
    scales = torch.zeros(1, 8)
    with pytest.raises(ValueError, match="do not fit"):
        int4_gemv.gemv(torch.zeros(2, 128), weight, scales, scales)
