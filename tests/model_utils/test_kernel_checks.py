"""At load, each weight shape's gemlite kernel multiplies random rows and its product is held
to the same weights dequantized (gemlite_checks.check_kernels): a kernel that runs but reads
the weights wrong moves the shape to another kernel instead of serving wrong replies. What the
check compares with, on the CPU, with the app's own layers; gemlite's side is a `gpu` test
(tests/gpu/test_weight_kernels.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from model_utils.layers.fp8_weights import Fp8Linear
from model_utils.layers.gemlite_checks import (
    CHECKED_OUTPUTS,
    PRODUCT_BOUND,
    SLICE_BOUND,
    WrongProduct,
    checked_outputs,
    checked_weight,
    off_product,
)
from model_utils.layers.int_quantization import dequantize_int4, quantize_int4
from model_utils.layers.weight_only import Int4WeightOnlyLinear, Int8WeightOnlyLinear

pytestmark = pytest.mark.unit


def linear(out_features: int = 1536, in_features: int = 256) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(in_features, out_features, bias=True, dtype=torch.bfloat16)


def test_the_checked_outputs_spread_over_the_whole_layer():
    outputs = checked_outputs(37888, torch.device("cpu"))
    assert len(outputs) == CHECKED_OUTPUTS
    assert outputs[0] == 0 and outputs[-1] == 37887
    assert (outputs.diff() > 0).all() and outputs.diff().max() <= 37888 // CHECKED_OUTPUTS + 1
    assert torch.equal(checked_outputs(100, torch.device("cpu")), torch.arange(100))


@pytest.mark.parametrize("kind", [Int8WeightOnlyLinear, Fp8Linear])
def test_an_8bit_layers_checked_weight_is_its_own_without_the_bias(kind):
    layer = kind(linear())
    outputs = checked_outputs(layer.out_features, torch.device("cpu"))[::3]
    # The weight alone: gemlite's op adds no bias either.
    assert torch.equal(checked_weight(layer, outputs), layer.dequantized(torch.float32)[outputs])


def test_int4_rows_round_as_in_the_whole_matrix():
    """The int4 check rounds only the checked rows of the bf16 weight: the same numbers as the
    whole matrix's rounding at those rows (each row's groups are rounded on their own)."""
    weight = linear(out_features=4100).weight  # more rows than are quantized at once
    rows = checked_outputs(4100, weight.device)
    whole = dequantize_int4(*quantize_int4(weight, 128), torch.float32)
    some = dequantize_int4(*quantize_int4(weight[rows], 128), torch.float32)
    assert torch.equal(some, whole[rows])


def test_a_product_off_the_weights_is_named_wrong():
    source = linear()
    layer = Int4WeightOnlyLinear(source, 128, kernel="dequantize")
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    outputs = checked_outputs(layer.out_features, x.device)

    def rows_of(rows):
        return dequantize_int4(*quantize_int4(source.weight[rows], 128), torch.float32)

    expected = x.float() @ checked_weight(layer, outputs, rows_of).T
    right = (F.linear(x, layer.dequantized(x.dtype)))[:, outputs].float()  # bf16 arithmetic
    assert off_product(right, expected) is None

    # What a misread layout gives: the two nibbles of each byte swapped, or the shift left out.
    q, scales, zeros = quantize_int4(source.weight, 128)
    swapped = q.view(q.shape[0], -1, 2).flip(-1).reshape(q.shape)
    no_shift = (q.float() - 8) * scales.float().repeat_interleave(128, 1)
    for weight in (dequantize_int4(swapped, scales, zeros, torch.float32), no_shift):
        wrong = (x.float() @ weight.T)[:, outputs]
        assert isinstance(off_product(wrong, expected), WrongProduct)
    failure = off_product(torch.full_like(expected, float("nan")), expected)
    assert isinstance(failure, WrongProduct) and str(PRODUCT_BOUND) in str(failure)


def test_a_misread_confined_to_one_row_or_tile_is_named_wrong_too():
    """One input row of 1024, or two output features of 512, multiplied 25-30% wrong moves
    the whole product's norm by 1-2%, under PRODUCT_BOUND: each row's and column's own error
    is bounded as well. bf16-sized noise everywhere passes."""
    torch.manual_seed(0)
    expected = torch.randn(1024, 512)
    noisy = expected + 0.004 * expected.abs() * torch.randn_like(expected)
    assert off_product(noisy, expected) is None
    one_row, one_tile = expected.clone(), expected.clone()
    one_row[300] *= 1.3
    one_tile[:, 32:34] *= 1.25
    for wrong in (one_row, one_tile):
        overall = ((wrong - expected).norm() / expected.norm()).item()
        assert overall < PRODUCT_BOUND
        failure = off_product(wrong, expected)
        assert isinstance(failure, WrongProduct) and str(SLICE_BOUND) in str(failure)


def test_an_int4_layer_takes_its_checked_weight_from_the_caller():
    """An int4 layer's check is held to rows from the caller, who still has the bf16 weight,
    not to the layer's own packed layout (the kernel's reading of it is what is checked)."""
    layer = Int4WeightOnlyLinear(linear(), 128, kernel="dequantize")
    assert checked_weight(layer, checked_outputs(layer.out_features, torch.device("cpu"))) is None
