"""MSLK's int4 layout on the CPU: the numbers it is handed (its kernel needs a Hopper GPU:
tests/gpu/test_weight_kernels.py)."""

import torch

from model_utils.layers import mslk_int4
from model_utils.layers.weight_only import int4_kernel


def unpack_signed(packed: torch.Tensor) -> torch.Tensor:
    """MSLK's reading of a byte: the low nibble, then the high one, each 4-bit signed."""
    low = (packed << 4) >> 4  # arithmetic shifts of int8 carry the nibble's sign
    high = packed >> 4
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)


def test_the_app_s_int4_numbers_become_mslk_s_signed_nibbles():
    q = torch.randint(0, 16, (8, 64), dtype=torch.uint8)
    packed = mslk_int4.signed_nibbles(q)
    assert packed.dtype == torch.int8 and packed.shape == (8, 32)
    assert torch.equal(unpack_signed(packed), q.to(torch.int8) - 8)


def test_mslk_is_not_picked_off_a_gpu():
    assert "CUDA" in mslk_int4.unavailable_reason(torch.device("cpu"), torch.bfloat16)
    assert int4_kernel(torch.device("cpu"), torch.bfloat16) == "dequantize"


def test_a_kernel_that_cannot_serve_a_shape_hands_it_to_the_next(caplog):
    """Forced onto MSLK where it cannot run (here: no GPU), the shape's first layer falls to
    the next path, says so in the log, and the shape's later layers follow it."""
    from model_utils.layers.weight_only import _int4_layer

    linear = torch.nn.Linear(256, 64, dtype=torch.bfloat16)
    kernels = {}
    layer = _int4_layer(linear, 128, kernels, "mslk")
    assert layer.kernel == "dequantize" and kernels == {(64, 256): "dequantize"}
    assert "mslk's int4 kernels do not serve 64x256 weights here" in caplog.text
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    expected = x.float() @ layer.dequantized(torch.float32).T + linear.bias.float()
    torch.testing.assert_close(layer(x).float(), expected, rtol=0.02, atol=0.02)
    assert _int4_layer(linear, 128, kernels, "mslk").kernel == "dequantize"
