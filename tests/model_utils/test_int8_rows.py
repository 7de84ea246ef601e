"""int8-wo's weights in the tensor cores' fragment order and the kernel for a few rows over
them (int8_rows), on the CPU: the order and back, the kernel's numbers and index algebra
through Triton's interpreter (the shift-and-mask twin of its inline asm), and its compiled form
for a Hopper GPU, built here without one. The asm itself is held to the dequantized product on
a GPU (tests/gpu/test_weight_kernels.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from model_utils.layers import int8_rows, mslk_gemv
from model_utils.layers.int_quantization import quantize_int8

from .triton_interpreter import patch_interpreter, run_interpreted

pytestmark = pytest.mark.unit


def test_the_fragment_order_puts_a_lanes_four_weights_in_one_word_and_comes_back():
    q = torch.randint(-127, 128, (32, 64), dtype=torch.int8,
                      generator=torch.Generator().manual_seed(1))
    packed = int8_rows.pack(q)
    assert torch.equal(int8_rows.unpack(packed), q)
    # atom (0, 0), word 32 v_r + 4 t1 + t0: output t1 + 8 v_r, inputs 2 t0, 2 t0 + 8, 2 t0 + 1,
    # 2 t0 + 9; the next atom down the outputs follows it
    flat = packed.reshape(-1)
    for v_r, t1, t0 in ((0, 0, 0), (1, 3, 2), (0, 7, 3)):
        word = flat[(32 * v_r + 4 * t1 + t0) * 4:][:4]
        row = t1 + 8 * v_r
        assert word.tolist() == [q[row, c].item() for c in (2 * t0, 2 * t0 + 8, 2 * t0 + 1,
                                                            2 * t0 + 9)]
    assert flat[256:260].tolist() == [q[16, c].item() for c in (0, 8, 1, 9)]
    with pytest.raises(ValueError, match="16x16 atoms"):
        int8_rows.pack(q[:24])


# (outputs, inputs, rows, (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages)); fp16 x (the
# interpreter's bf16 tl.dot is wrong)
CASES = [
    (64, 256, 3, (64, 64, 1, 4, 2)),
    (48, 384, 8, (32, 64, 3, 4, 2)),  # a part block of outputs, three shares summed
    (32, 256, 20, (32, 32, 2, 4, 2)),  # 32 rows a block
    (32, 128, 70, None),  # a prompt's rows: blocks of 64, the last a part
]


def check_cases() -> None:
    patch_interpreter()
    for n, k, rows, launch in CASES:
        generator = torch.Generator().manual_seed(n + rows)
        q, scales = quantize_int8(torch.randn(n, k, generator=generator))
        assert q.min() < -64 and q.max() > 64  # both signs, every kind of high nibble
        x2 = torch.randn(rows, k, generator=generator).half()
        expected = x2.float() @ (q.float() * scales.float()[:, None]).T
        space = mslk_gemv.workspace(min(rows, int8_rows.MOST_ROWS), n, x2.device)
        y = int8_rows.product(x2, int8_rows.pack(q), scales.half(), launch=launch, space=space)
        assert y.dtype == torch.float16 and y.shape == (rows, n)
        error = ((y.float() - expected).norm() / expected.norm()).item()
        assert error < 1e-2, (n, k, rows, launch, error)
        assert not space[0].any() and not space[1].any(), (n, k, rows, launch)
        wrong = int8_rows.product(x2, q, scales.half(), launch=launch)  # the natural order
        assert ((wrong.float() - expected).norm() / expected.norm()).item() > 0.1
        print(f"{n}x{k}, {rows} rows: relative error {error:.1e}")


def test_the_kernel_computes_the_dequantized_product():
    pytest.importorskip("triton")
    done = run_interpreted("tests.model_utils.test_int8_rows", "check_cases")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("relative error") == len(CASES), done.stdout


def test_shapes_that_do_not_fit_are_refused_plainly():
    weight, scales = torch.zeros(32, 128, dtype=torch.int8), torch.zeros(32)
    with pytest.raises(ValueError, match="do not fit"):
        int8_rows.product(torch.zeros(2, 128), weight, scales)  # fp32 x
    with pytest.raises(ValueError, match="do not fit"):  # a workspace for fewer rows
        int8_rows.product(torch.zeros(3, 128, dtype=torch.half), weight, scales,
                          space=mslk_gemv.workspace(2, 32, torch.device("cpu")))
    with pytest.raises(ValueError, match="does not tile"):
        int8_rows.product(torch.zeros(2, 96, dtype=torch.half), torch.zeros(32, 96,
                          dtype=torch.int8), scales, launch=(32, 64, 1, 4, 2))


def test_the_kernel_compiles_for_hopper_onto_wgmma_without_spilling():
    """Compiled for a Hopper GPU without one (benchmarks/gemv_compiled.py --int8): the weights
    feed wgmma (HGMMA) from registers, nothing spilled."""
    pytest.importorskip("triton.backends.nvidia")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from gemv_compiled import report

    found = report(8, 128, 64, 4, 4, chunk=64, swapped="int8", stages=3)
    assert found["tensor_cores"] == "HGMMA", found
    assert found["spilled_bytes"] == 0, found
