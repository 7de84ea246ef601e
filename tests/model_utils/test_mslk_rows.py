"""The tensor-core kernel for a few rows over MSLK's int4 copy (mslk_rows), on the CPU: its
numbers and index algebra through Triton's interpreter (which runs the shift-and-mask twin of
its inline-asm conversion), and its compiled form for a Hopper GPU, built here without one. The
asm itself is held to the dequantized product on a GPU (tests/gpu/test_weight_kernels.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from model_utils.layers import mslk_gemv, mslk_layout, mslk_rows
from model_utils.layers.int_quantization import dequantize_int4, quantize_int4
from model_utils.layers.mslk_int4 import signed_nibbles

from .triton_interpreter import patch_interpreter, run_interpreted

pytestmark = pytest.mark.unit

# (outputs, inputs, group, rows, (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages)); fp16 x (the
# interpreter's bf16 tl.dot is wrong)
CASES = [
    (64, 256, 64, 3, (64, 64, 1, 4, 2)),
    (48, 384, 128, 8, (32, 64, 3, 4, 2)),  # a part block of outputs, three shares summed
    (64, 512, 128, 16, (32, 128, 0, 4, 2)),  # a share a group
    (32, 256, 128, 20, (32, 32, 2, 4, 2)),  # 32 rows a block, four steps a group
]


def check_cases() -> None:
    patch_interpreter()
    for n, k, group, rows, launch in CASES:
        generator = torch.Generator().manual_seed(n + rows)
        q, scales, zeros = quantize_int4(torch.randn(n, k, generator=generator), group)
        x2 = torch.randn(rows, k, generator=generator).half()
        expected = x2.float() @ dequantize_int4(q, scales, zeros, torch.float32).T
        copy = mslk_layout.shuffle(signed_nibbles(q), mslk_gemv.LAYOUT)
        numbers = (scales.t().contiguous().half(), zeros.t().contiguous().half())
        space = mslk_gemv.workspace(rows, n, x2.device)
        y = mslk_rows.product(x2, copy, *numbers, launch=launch, space=space)
        assert y.dtype == torch.float16 and y.shape == (rows, n)
        error = ((y.float() - expected).norm() / expected.norm()).item()
        assert error < 1e-2, (n, k, rows, launch, error)
        assert not space[0].any() and not space[1].any(), (n, k, rows, launch)
        other = mslk_layout.shuffle(signed_nibbles(q), mslk_layout.Layout(
            16, 16, True, tuple(torch.randperm(256, generator=generator).tolist())))
        wrong = mslk_rows.product(x2, other, *numbers, launch=launch)
        assert ((wrong.float() - expected).norm() / expected.norm()).item() > 0.1
        print(f"{n}x{k} group {group}, {rows} rows: relative error {error:.1e}")


def test_the_rows_kernel_computes_the_dequantized_product():
    pytest.importorskip("triton")
    done = run_interpreted("tests.model_utils.test_mslk_rows", "check_cases")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("relative error") == len(CASES), done.stdout


def test_shapes_that_do_not_fit_are_refused_plainly():
    weight, scales = torch.zeros(32, 64, dtype=torch.int8), torch.zeros(1, 32)
    with pytest.raises(ValueError, match="do not fit"):  # fp32 x: no magic number for it
        mslk_rows.product(torch.zeros(2, 128), weight, scales, scales)
    with pytest.raises(ValueError, match="does not tile"):
        mslk_rows.product(torch.zeros(2, 128, dtype=torch.half), torch.zeros(24, 64,
                          dtype=torch.int8), torch.zeros(1, 24), torch.zeros(1, 24),
                          launch=(32, 64, 1, 4, 2))


@pytest.mark.parametrize("rows, block_n, warps", [(8, 128, 4), (32, 256, 8)])
def test_the_weights_reach_the_tensor_cores_without_moving_between_threads(rows, block_n, warps):
    """Compiled for a Hopper GPU without one (benchmarks/gemv_compiled.py --swapped): the
    converted weights are the wgmma's register operand as they come out of each thread's asm
    (no layout conversion into it), nothing spilled."""
    pytest.importorskip("triton.backends.nvidia")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from gemv_compiled import report

    found = report(rows, block_n, 64, split_k=4, warps=warps, swapped=True, stages=3)
    assert found["tensor_cores"] == "HGMMA", found
    assert found["operand_conversions"] == 0, found
    assert found["spilled_bytes"] == 0, found


def test_x_s_sums_need_no_reduction_inside_the_loop():
    """At the launch the H100 search chose for every shape (64 outputs, 64 inputs a step, 4
    warps), the zero points' sums of x come out of the tensor cores in the accumulator's layout:
    no shuffle and no layout conversion in the compiled loop."""
    pytest.importorskip("triton.backends.nvidia")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from gemv_compiled import report

    for rows in (2, 32):
        found = report(rows, 64, 64, split_k=14, warps=4, swapped=True, stages=3)
        assert found["shuffles"] == 0 and found["inner_loop_conversions"] == 0, found
