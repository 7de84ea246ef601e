"""MSLK's int4 layout read off a preshuffle, and the Triton GEMV that reads MSLK's copy, on the
CPU (the kernel through Triton's interpreter). The preshuffle here is mslk_layout's own shuffle
with a random atom, so that the reading is held to a layout it did not assume; the GEMV reads
copies laid out in its LAYOUT by the same shuffle. MSLK's real layout is read and the GEMV held
to MSLK's own product on a GPU (tests/gpu/test_weight_kernels.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from model_utils.layers import mslk_gemv, mslk_layout
from model_utils.layers.int_quantization import dequantize_int4, quantize_int4
from model_utils.layers.mslk_int4 import signed_nibbles

from .triton_interpreter import patch_interpreter, run_interpreted

pytestmark = pytest.mark.unit


def random_layout(atom_n: int, atom_k: int, rows_first: bool, seed: int) -> mslk_layout.Layout:
    order = torch.randperm(atom_n * atom_k, generator=torch.Generator().manual_seed(seed))
    return mslk_layout.Layout(atom_n, atom_k, rows_first, tuple(order.tolist()))


@pytest.mark.parametrize("atom", [(16, 16, True), (16, 32, False), (8, 16, True)])
def test_the_layout_is_read_back_from_what_the_preshuffle_does(atom):
    truth = random_layout(*atom, seed=sum(atom[:2]))
    found = mslk_layout.read(lambda q, scales: mslk_layout.shuffle(signed_nibbles(q), truth),
                             torch.device("cpu"))
    # the same place for every weight (an 8x16 atom repeated rows first reads as 16x16)
    assert torch.equal(found.positions(128, 512), truth.positions(128, 512))


def test_a_preshuffle_that_is_no_tiling_of_one_atom_is_refused():
    with pytest.raises(mslk_layout.LayoutUnknown, match="not one permuted atom"):
        mslk_layout.read(lambda q, scales: signed_nibbles(q).flip(0), torch.device("cpu"))
    with pytest.raises(mslk_layout.LayoutUnknown, match="re-encodes"):
        mslk_layout.read(lambda q, scales: signed_nibbles(q & 7), torch.device("cpu"))


def test_the_app_packs_the_layout_itself_as_the_table_places_it():
    q = torch.randint(0, 16, (96, 384), dtype=torch.uint8,
                      generator=torch.Generator().manual_seed(3))
    assert torch.equal(mslk_gemv.pack(q), mslk_layout.shuffle(signed_nibbles(q), mslk_gemv.LAYOUT))
    with pytest.raises(ValueError, match="16x16 atoms"):
        mslk_gemv.pack(q[:40])


# (outputs, inputs, group, rows, (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages[, CHUNK[, FMA]]),
#  x dtype)
CASES = [
    (48, 256, 64, 1, (32, 64, 1, 4, 2), torch.float32),  # a part block of outputs
    # K split in three shares, summed in the fp32 workspace, written in x's dtype
    (64, 384, 128, 1, (64, 128, 3, 4, 2), torch.float16),
    (64, 384, 128, 2, (64, 128, 3, 4, 2, 128, 1), torch.bfloat16),
    (32, 256, 128, 3, (32, 32, 1, 4, 2), torch.float32),  # four steps a group
    (64, 512, 64, 8, (32, 64, 2, 4, 2), torch.float32),
    (64, 256, 64, 1, (64, 64, 1, 4, 2), torch.bfloat16),
    # tensor cores from two rows, in fp16 (the interpreter's bf16 tl.dot is wrong)
    (64, 256, 64, 5, (32, 32, 2, 4, 2), torch.float16),
    # one program a chunk of half a group (gemlite's shape of work), one row and three
    (64, 512, 128, 1, (32, 32, 0, 4, 1, 64), torch.float32),
    (48, 256, 128, 3, (32, 32, 0, 4, 1, 64), torch.float16),
    # a few rows through the FMA kernel (its rows' sums in registers: 3 of 4, 8 of 8)
    (48, 256, 128, 3, (32, 32, 0, 4, 1, 64, 1), torch.float32),
    (64, 384, 128, 8, (64, 64, 2, 4, 2, 128, 1), torch.float16),
    # more rows than tl.dot's 16 (32 a block) on the tensor-core kernel, an FMA launch too
    (64, 256, 64, 20, (32, 32, 2, 4, 2), torch.float16),
    (48, 256, 128, 32, (32, 32, 0, 4, 1, 64, 1), torch.float16),
]


def check_cases() -> None:
    patch_interpreter()
    for n, k, group, rows, launch, dtype in CASES:
        generator = torch.Generator().manual_seed(n + rows)
        q, scales, zeros = quantize_int4(torch.randn(n, k, generator=generator), group)
        x2 = torch.randn(rows, k, generator=generator).to(dtype)
        expected = x2.float() @ dequantize_int4(q, scales, zeros, torch.float32).T
        copy = mslk_layout.shuffle(signed_nibbles(q), mslk_gemv.LAYOUT)
        numbers = (scales.t().contiguous(), zeros.t().contiguous())
        space = mslk_gemv.workspace(rows, n, x2.device)
        y = mslk_gemv.gemv(x2, copy, *numbers, launch=launch, space=space)
        assert y.dtype == dtype and y.shape == (rows, n)
        error = ((y.float() - expected).norm() / expected.norm()).item()
        assert error < {torch.float32: 1e-5}.get(dtype, 1e-2), (n, k, rows, dtype, error)
        # the workspace is left as found, and serves the next product
        assert not space[0].any() and not space[1].any(), (n, k, rows, launch)
        assert torch.equal(mslk_gemv.gemv(x2, copy, *numbers, launch=launch, space=space), y)
        # the same weights in another order are another product: the order is what it reads
        other = mslk_layout.shuffle(signed_nibbles(q), random_layout(16, 16, True, seed=k))
        wrong = mslk_gemv.gemv(x2, other, *numbers, launch=launch)
        assert ((wrong.float() - expected).norm() / expected.norm()).item() > 0.1
        print(f"{n}x{k} group {group}, {rows} rows, {dtype}: relative error {error:.1e}")


def test_the_gemv_computes_the_dequantized_product():
    pytest.importorskip("triton")
    done = run_interpreted("tests.model_utils.test_mslk_gemv", "check_cases")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("relative error") == len(CASES), done.stdout


def test_shapes_that_do_not_fit_are_refused_plainly():
    weight, scales = torch.zeros(32, 64, dtype=torch.int8), torch.zeros(1, 32)
    with pytest.raises(ValueError, match="do not fit"):
        mslk_gemv.gemv(torch.zeros(2, 256), weight, scales, scales)
    with pytest.raises(ValueError, match="do not fit"):
        mslk_gemv.gemv(torch.zeros(mslk_gemv.MOST_ROWS + 1, 128), weight, scales, scales)
    with pytest.raises(ValueError, match="do not fit"):  # a workspace for fewer rows
        mslk_gemv.gemv(torch.zeros(3, 128), weight, scales, scales,
                       space=mslk_gemv.workspace(2, 32, torch.device("cpu")))
    with pytest.raises(ValueError, match="does not tile"):
        mslk_gemv.gemv(torch.zeros(1, 128), torch.zeros(24, 64, dtype=torch.int8),
                       torch.zeros(1, 24), torch.zeros(1, 24), launch=(32, 64, 1, 4, 2))


def test_the_layout_the_gemv_reads_is_mslk_s_as_read_on_an_h100():
    """The table read off MSLK 1.1.0's preshuffle on an H100 (tests/gpu/test_weight_kernels.py
    printed it; benchmarks/h100-2026-12-07/gpu-tests-mslk-layout.log), its first two words:
    rows 0 and 8 at inputs 0, 8, 1, 9, then 2, 10, 3, 11."""
    table = mslk_gemv.LAYOUT.table
    assert [table[r * 16 + c] for r, c in ((0, 0), (8, 0), (0, 8), (8, 8), (0, 1), (8, 1),
                                          (0, 9), (8, 9), (0, 2), (1, 0))] == [
        0, 1, 2, 3, 4, 5, 6, 7, 8, 32]
    assert sorted(table) == list(range(256))


@pytest.mark.parametrize("block_n, block_k", [(128, 64), (64, 32)])
def test_the_one_row_kernel_keeps_its_values_where_they_are(block_n, block_k):
    """Compiled for a Hopper GPU without one (benchmarks/gemv_compiled.py): no layout
    conversion inside the one-row kernel's innermost loop, nothing spilled. Each conversion
    moves every value of a tensor between threads, once per step; the GEMV that had eight a
    step ran at half gemlite's speed on a GPU."""
    pytest.importorskip("triton.backends.nvidia")
    found = compiled_report(1, block_n, block_k)
    assert found["inner_loop_conversions"] == 0, found
    assert found["spilled_bytes"] == 0, found


def test_the_tensor_core_kernel_compiles_without_spilling():
    pytest.importorskip("triton.backends.nvidia")
    found = compiled_report(8, 64, 64)
    assert found["spilled_bytes"] == 0, found


def compiled_report(rows: int, block_n: int, block_k: int) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from gemv_compiled import report

    return report(rows, block_n, block_k, split_k=4, warps=4)


def test_the_shipped_launches_tile_their_shapes_and_another_hopper_gpu_borrows_them():
    shipped = json.loads(mslk_gemv.CONFIGS_FILE.read_text())
    for gpu, shapes in shipped.items():
        for shape, by_rows in shapes.items():
            n, k = (int(v) for v in shape.split("x"))
            for rows, launch in by_rows.items():
                if rows.isdigit():  # the launch's tiling, as gemv checks it (group 128)
                    block_n, block_k, _split, _warps, _stages, *chunk = launch
                    chunk = chunk[0] if chunk else 128
                    assert n % 16 == 0 and 128 % chunk == 0 and chunk % block_k == 0, launch
                    assert block_n % 16 == 0 and block_k % 16 == 0 and k % chunk == 0, launch
    h100 = "NVIDIA H100 80GB HBM3"
    assert mslk_gemv._shape_configs("NVIDIA H200", "3584x18944") == shipped[h100]["3584x18944"]
    assert mslk_gemv._shape_configs("NVIDIA H200", "1x16") == {}
