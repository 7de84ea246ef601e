"""fp8 (e4m3) weights with per-row scales (model_utils/layers/fp8_weights.py) on the CPU, whose
torch runs the same _scaled_mm arithmetic as a GPU: the numbers stored, the product against its
definition for prompt rows, the weight-only product for decode rows, and the layers kept at
other shapes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from model_utils.layers.fp8_weights import (
    FP8_MAX,
    Fp8Linear,
    quantize_fp8,
    quantize_rows,
    unavailable_reason,
)
from model_utils.layers.weight_only import quantizable


def linear(k=256, n=128, bias=False, seed=0):
    torch.manual_seed(seed)
    layer = nn.Linear(k, n, bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.mul_(torch.logspace(-2, 1, n, dtype=torch.bfloat16)[:, None])  # rows apart
    return layer


def test_each_row_is_stored_to_e4m3s_precision_with_its_own_scale():
    weight = linear().weight
    q, scales = quantize_fp8(weight)
    assert q.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert q.float().abs().amax(-1).allclose(torch.full_like(scales, FP8_MAX))  # range used
    back = q.float() * scales[:, None]
    # three mantissa bits: within 2^-4 of each value, plus the smallest step near zero
    err = (back - weight.float()).abs()
    assert (err <= weight.float().abs() / 16 + scales[:, None] * 2 ** -9).all()


@pytest.mark.parametrize("rows", [64, 97])
def test_prompt_rows_take_the_scaled_fp8_product(rows):
    layer = linear(bias=True)
    fp8 = Fp8Linear(layer)
    x = torch.randn(rows, 256, dtype=torch.bfloat16)
    xq, x_scales = quantize_rows(x)
    expected = (xq.float() * x_scales) @ (fp8.qweight.float() * fp8.scales[:, None]).T
    got = fp8(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected + layer.bias.float(), rtol=1e-2, atol=1e-2)
    # and near the bf16 layer it came from: the error of 8-bit inputs and weights
    full = layer(x).float()
    assert (got.float() - full).norm() / full.norm() < 0.06


@pytest.mark.parametrize("rows", [1, 5, 33, 63])
def test_decode_rows_take_the_weight_only_product(rows):
    """Below 64 rows (every decode batch) the input stays bf16: only the weights' rounding."""
    layer = linear(bias=True)
    fp8 = Fp8Linear(layer)
    x = torch.randn(rows, 256, dtype=torch.bfloat16)
    expected = x.float() @ fp8.dequantized(torch.float32).T + layer.bias.float()
    got = fp8(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2)
    full = layer(x).float()
    xq, x_scales = quantize_rows(x)  # what _scaled_mm would have multiplied
    both = (xq.float() * x_scales) @ fp8.dequantized(torch.float32).T + layer.bias.float()
    assert (got.float() - full).norm() < (both - full).norm()


def test_few_rows_can_take_the_weight_only_product_and_shapes_are_kept():
    layer = linear()
    fp8 = Fp8Linear(layer, scaled_mm_from_rows=4)
    x = torch.randn(2, 3, 256, dtype=torch.bfloat16)  # 6 rows: _scaled_mm
    assert fp8(x).shape == (2, 3, 128)
    one = torch.randn(1, 1, 256, dtype=torch.bfloat16)  # 1 row: unquantized input
    expected = torch.nn.functional.linear(one.float(), fp8.dequantized(torch.float32))
    torch.testing.assert_close(fp8(one).float(), expected, rtol=1e-2, atol=1e-2)


def test_layers_whose_sizes_scaled_mm_cannot_take_keep_their_weights():
    assert quantizable("model.layers.0.mlp.up_proj", nn.Linear(64, 32), 8, None, "fp8")
    assert not quantizable("model.layers.0.linear_attn.in_proj_a", nn.Linear(64, 4), 8, None,
                           "fp8")
    assert not quantizable("lm_head", nn.Linear(64, 32), 8, None, "fp8")


def test_the_cpu_can_run_it():
    assert unavailable_reason("cpu") is None


def test_the_shipped_gemlite_configs_are_picked_by_the_gpu_they_were_tuned_on():
    import json

    from model_utils.layers.gemlite_weights import shipped_configs

    assert shipped_configs("NVIDIA H200").name == "h200.json"
    assert shipped_configs("NVIDIA H100 80GB HBM3").name == "h100.json"
    assert shipped_configs("NVIDIA A100-SXM4-80GB") is None
    for name in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"):
        table = json.loads(shipped_configs(name).read_text())
        # gemlite's table: kernel kind -> "(rows, N, K, ...)" -> the launch settings
        assert table and all(key.startswith("(") and "num_warps" in config
                             for kind in table.values() for key, config in kind.items())
