"""The fast quantized layers' GPU kernels against the weights they hold, dequantized to fp32:
int4 through tinygemm, gemlite and MSLK (every row count; against the same numbers kept
unpacked), int8 weight-only and fp8 (weight-only below 64 rows, _scaled_mm above) with and
without gemlite's kernels for the decode rows, at decode row counts and prefill lengths, eager
and compiled (the decode step's graphs replay the compiled form)."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from model_utils.bench.logprob_check import dequantized_weight
from model_utils.layers import (
    gemlite_checks,
    gemlite_weights,
    int8_rows,
    mslk_gemv,
    mslk_int4,
    mslk_rows,
)
from model_utils.layers.fp8_weights import Fp8Linear
from model_utils.layers.int_quantization import quantize_int8
from model_utils.layers.weight_only import Int4WeightOnlyLinear, Int8WeightOnlyLinear

from .conftest import gpu_marks

pytestmark = gpu_marks()

ROWS = [1, 2, 4, 7, 31, 64, 512, 1024]  # int4: GEMV at 1, split-K GEMM at 2-63
# The layers are 3584 x 3584, Qwen2.5-7B's attention output: gemlite's configs for it are
# shipped for both GPUs (other shapes are tuned at each row bucket's first use, minutes in all).
OUT_FEATURES = 3584
# Relative error of the product against fp32 over the stored weights: bf16 arithmetic for the
# weight-only layers; fp8 from 64 rows also rounds each input to e4m3 (three mantissa bits).
BOUND = {"int4": 0.01, "int8": 0.01, "fp8": 0.06, "int4-gemlite": 0.01, "int8-gemlite": 0.01,
         "fp8-gemlite": 0.06, "int4-mslk": 0.01}


def linear_layer(in_features: int = 3584) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(in_features, OUT_FEATURES, bias=False, dtype=torch.bfloat16, device="cuda")


def layer(kind: str) -> nn.Module:
    if kind == "int4-mslk":
        if reason := mslk_int4.unavailable_reason(torch.device("cuda"), torch.bfloat16):
            pytest.skip(reason)
        return Int4WeightOnlyLinear(linear_layer(), 128, kernel="mslk")
    gemlite = kind.endswith("gemlite")
    if gemlite and (reason := gemlite_weights.unavailable_reason(torch.device("cuda"),
                                                                 torch.bfloat16)):
        pytest.skip(reason)
    linear = linear_layer()
    if kind.startswith("int4"):
        return Int4WeightOnlyLinear(linear, 128, kernel="gemlite" if gemlite else "tinygemm")
    module = Int8WeightOnlyLinear(linear) if kind.startswith("int8") else Fp8Linear(linear)
    if gemlite:
        assert gemlite_weights.attach(module), "3584 input features: a shape gemlite takes"
    return module


def stored_weight(kind: str, module: nn.Module) -> torch.Tensor:
    """The fp32 weight the layer holds: int4's from the same numbers kept unpacked (the
    quantization is deterministic), not from the kernels' own layouts (tinygemm's is read by
    its kernel alone; gemlite's read back is tested below against the same reference)."""
    if kind.startswith("int4"):
        return Int4WeightOnlyLinear(linear_layer(), 128, kernel="dequantize").dequantized(
            torch.float32)
    return dequantized_weight(module).to("cuda")


def product_errors(forward, weight: torch.Tensor, rows_list) -> dict[int, float]:
    """{rows: the relative error of forward(x) against x @ weight.T in fp32} for random bf16
    rows x of each count."""
    errors = {}
    for rows in rows_list:
        x = torch.randn(rows, weight.shape[1], dtype=torch.bfloat16, device="cuda")
        with torch.inference_mode():
            got = forward(x).float()
        expected = x.float() @ weight.T
        errors[rows] = ((got - expected).norm() / expected.norm()).item()
    return errors


def assert_products(forward, weight: torch.Tensor, rows_list, bound: float) -> None:
    errors = product_errors(forward, weight, rows_list)
    assert max(errors.values()) < bound, errors


@pytest.mark.parametrize("kind", list(BOUND))
@pytest.mark.parametrize("compiled", [False, True])
def test_the_kernel_computes_the_product_of_the_stored_weights(kind, compiled):
    module = layer(kind)
    weight = stored_weight(kind, module)
    forward = torch.compile(module, dynamic=False) if compiled else module
    for rows, error in product_errors(forward, weight, ROWS).items():
        print(f"{kind} compiled={compiled} rows={rows}: {error:.2e} of the product")
        assert error < BOUND[kind], (kind, rows, error)


def test_gemlite_multiplies_int4_by_its_gemv_for_one_row_only():
    layer("int4-gemlite")  # imports gemlite, or skips
    import gemlite.core as core

    assert [core.get_matmul_type(rows, 4) for rows in (1, 2, 4, 5, 64)] == [
        "GEMV_REVSPLITK", "GEMM_SPLITK", "GEMM_SPLITK", "GEMM_SPLITK", "GEMM"]
    assert core.get_matmul_type(2, 8) == "GEMV_SPLITK"  # 8-bit weights: gemlite's own choice


def test_a_tuned_config_the_gpu_cannot_launch_is_tuned_anew():
    """gemlite keys its tuned configs by shape, row bucket and input type, not the weight's
    type: a config tuned on e4m3 weights reached int8 ones whose kernel needed more shared
    memory than the GPU has, and the mode failed to load. check_kernels forgets such a config
    and tunes the shape again before any graph meets it; the product is then right."""
    import gemlite.core as core

    module = layer("int8-gemlite")
    meta = module.gemlite_meta
    rows = 8  # gemlite's split-K GEMM, bucket 8
    gemlite_checks.forget_tuned(module, rows)  # what earlier tests tuned for this shape
    shape = (module.out_features, module.in_features, meta[2], meta[4], 100 + meta[1])
    # A 256x256 int8 tile in eight stages: 512 KB of shared memory, more than any GPU has.
    core.GEMLITE_TRITON_CONFIG_CACHE.setdefault("GEMM_SPLITK", {})[str((rows, *shape))] = {
        "BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 256, "GROUP_SIZE_M": 8,
        "SPLIT_K": 1, "A_load_order": 0, "NUM_STAGES": 8, "num_warps": 8, "num_ctas": 1,
        "num_stages": 8}

    repairs = gemlite_checks.check_kernels(module)
    # Launched at the bucket's smallest row count: one launch stands for every count in it.
    assert len(repairs) == 1 and f"-{rows} rows" in repairs[0] and "tuned anew" in repairs[0]
    assert module.gemlite_meta is not None  # still served by gemlite
    assert_products(module, dequantized_weight(module).to("cuda"), [7], BOUND["int8-gemlite"])


def test_gemlite_int4_keeps_one_packed_copy_of_the_weights_and_the_apps_shift():
    """Half a byte a weight, and a bf16 scale and shift per 128 weights: no second copy,
    in gemlite's mode w = q * scale + shift, the shift the app's zero - 8 * scale (gemlite's
    own, from a zero point in q's units, is another rounding: too close for the product
    test's bound to tell apart)."""
    from model_utils.layers.int_quantization import quantize_int4

    gc.collect()  # earlier tests' leftovers, and gemlite's module (a reference cycle)
    before = torch.cuda.memory_allocated()
    module = layer("int4-gemlite")
    gc.collect()
    sizes = {name: t.numel() * t.element_size() for name, t in module.named_buffers()}
    groups = OUT_FEATURES * 3584 // 128
    assert sizes == {"packed": OUT_FEATURES * 3584 // 2, "gemlite_scales": groups * 2,
                     "gemlite_zeros": groups * 2, "gemlite_meta_scale": 4}, sizes
    held = torch.cuda.memory_allocated() - before
    # A second copy of any kind would add at least a quarter of the packed weight (an int8
    # or bf16 one far more); the allocator rounds each small tensor up to 512 bytes.
    assert held < sum(sizes.values()) + sizes["packed"] // 4, f"{held} bytes held for {sizes}"
    assert module.gemlite_meta[10] == 4  # W_group_mode: the fma form
    _, scales, zeros = quantize_int4(linear_layer().weight, 128)
    shift = (zeros.float() - 8 * scales.float()).to(torch.bfloat16).t()
    assert torch.equal(module.gemlite_zeros, shift)
    assert torch.equal(module.gemlite_scales, scales.t())


def test_gemlite_int4_takes_a_row_of_one_group():
    """128 input features in groups of 128: packed as two groups of 64 with the row's scale
    and shift each (gemlite reads one group a row as per-row scales, without a shift)."""
    if reason := gemlite_weights.unavailable_reason(torch.device("cuda"), torch.bfloat16):
        pytest.skip(reason)
    module = Int4WeightOnlyLinear(linear_layer(128), 128, kernel="gemlite")
    weight = Int4WeightOnlyLinear(linear_layer(128), 128, kernel="dequantize").dequantized(
        torch.float32)
    assert_products(module, weight, (1, 7, 64), BOUND["int4-gemlite"])


def test_a_gemlite_int4_kernel_that_reads_the_weights_wrong_fails_its_check():
    """check_kernels holds each launch's product to the weights' own numbers (check_launch):
    an int4 layer whose shifts were lost (zeroed here) runs without error but multiplies other
    weights; the load moves such a shape to tinygemm (KernelFailure) instead of serving it."""
    from model_utils.layers.int_quantization import dequantize_int4, quantize_int4

    module = layer("int4-gemlite")
    source = linear_layer()

    def rows_of(rows):
        return dequantize_int4(*quantize_int4(source.weight[rows], 128), torch.float32)

    outputs = gemlite_checks.checked_outputs(module.out_features, torch.device("cuda"))
    weight = gemlite_checks.checked_weight(module, outputs, rows_of)
    inputs = [torch.randn(rows, 3584, dtype=torch.bfloat16, device="cuda") for rows in ROWS]
    for x in inputs:  # gemlite's GEMV, split-K GEMM and GEMM
        assert gemlite_checks.check_launch(module, x, outputs, weight) is None, len(x)
    module.gemlite_zeros.zero_()
    for x in inputs:
        failure = gemlite_checks.check_launch(module, x, outputs, weight)
        assert isinstance(failure, gemlite_checks.WrongProduct), (len(x), failure)


def test_gemlite_int4_reads_back():
    """gemlite's int4 layout read back on the GPU (the compiled unpacking) is the weight of
    the numbers before packing, in gemlite's form q * scale + shift (the app's (q - 8) *
    scale + zero parts from it by the shift's bf16 rounding, 3e-3 of the weight)."""
    from model_utils.layers.int_quantization import quantize_int4

    module = layer("int4-gemlite")
    q, scales, zeros = quantize_int4(linear_layer().weight, 128)
    shifts = (zeros.float() - 8 * scales.float()).to(torch.bfloat16)
    expected = (q.float().reshape(OUT_FEATURES, -1, 128) * scales.float().unsqueeze(-1)
                + shifts.float().unsqueeze(-1)).reshape(OUT_FEATURES, 3584)
    read_back = module.dequantized(torch.float32)
    assert read_back.shape == expected.shape
    assert (read_back - expected).abs().max() <= 1e-6 * expected.abs().max()


def test_a_shape_without_tuned_configs_runs_with_borrowed_ones_held_to_its_weights(monkeypatch):
    """2560 x 3584 int4 has no config in any shipped table: its load (weight_only._int4_layer)
    borrows the nearest tuned shape's for every row bucket up to the prefill graphs' 1024 rows,
    so nothing is tuned, and the load check holds them to the weights (gemlite serves it)."""
    from model_utils.layers import gemlite_borrowed, weight_only
    from model_utils.layers.int_quantization import dequantize_int4, quantize_int4

    if reason := gemlite_weights.unavailable_reason(torch.device("cuda"), torch.bfloat16):
        pytest.skip(reason)
    monkeypatch.setattr(gemlite_borrowed, "BORROWED", set())
    monkeypatch.setattr(gemlite_borrowed, "_SEEN", set())
    torch.manual_seed(0)
    source = nn.Linear(3584, 2560, bias=False, dtype=torch.bfloat16, device="cuda")
    kernels = {}
    module = weight_only._int4_layer(source, 128, kernels, "gemlite")
    assert kernels == {(2560, 3584): "gemlite"} and module.kernel == "gemlite"
    assert gemlite_borrowed.BORROWED  # nothing shipped for it: every config borrowed
    for first, last in gemlite_checks._row_buckets(module, 1025):
        assert gemlite_weights.tuned_config(module, first), (first, last)
    weight = dequantize_int4(*quantize_int4(source.weight, 128), torch.float32)
    assert_products(module, weight, (1, 32, 512), BOUND["int4-gemlite"])


def test_mslk_reads_back_the_int4_weights_it_holds():
    """MSLK's shuffled layout is read back through its own kernel (the identity's product):
    the weights the tests and the logprob checks compare against."""
    module = layer("int4-mslk")
    read_back, stored = module.dequantized(torch.float32), stored_weight("int4", module)
    # The kernel dequantizes in bf16 (a rounding or two of each weight); a misread layout is
    # off by the weights' own size.
    assert ((read_back - stored).norm() / stored.norm()).item() < 1e-2


@pytest.mark.parametrize("in_features", [3584, 18944])  # the 7B's attention output, its down
def test_mslk_s_layout_is_the_gemv_s_and_the_gemv_agrees_with_mslk_s_own_product(in_features):
    """The layout read off MSLK's preshuffle here is the one mslk_gemv reads, and the GEMV over
    MSLK's copy gives MSLK's product at 1-32 rows, with the configured launch and with K split
    in several shares, down to one program a chunk of half a group (296 shares of the down
    projection's inputs, summed in the fp32 workspace, the last share's program writing them),
    and with a few rows through the FMA kernel; one workspace serves every product, left zeroed
    by each. The layer's own product (the GEMV or MSLK's GEMM, chosen inside one op) too."""
    if reason := mslk_int4.unavailable_reason(torch.device("cuda"), torch.bfloat16):
        pytest.skip(reason)
    module = Int4WeightOnlyLinear(linear_layer(in_features), 128, kernel="mslk")
    assert mslk_int4.gemv_reads_layout(module.packed.device), (
        "MSLK's int4 layout is not the GEMV's (the log says why)")
    weights = (module.packed, module.mslk_scales, module.mslk_zeros)
    space = mslk_gemv.workspace(mslk_gemv.MOST_ROWS, module.out_features, module.packed.device)
    for launch in (None, (64, 128, 4, 4, 2), (32, 32, 1, 4, 2), (128, 64, 8, 8, 2),
                   (512, 32, 0, 4, 1, 64), (64, 32, 0, 4, 1, 64, 1)):
        for rows in (1, 2, 3, 8, 20, 32):
            x = torch.randn(rows, in_features, dtype=torch.bfloat16, device="cuda")
            with torch.inference_mode():
                ours = mslk_gemv.gemv(x, *weights, launch=launch, space=space).float()
                theirs = torch.ops.mslk.bf16i4bf16_shuffled(x, *weights).float()
                layers = mslk_int4.layer_product(module, x).float()
            error = ((ours - theirs).norm() / theirs.norm()).item()
            assert error < 1e-2, (launch, rows, error)
            assert ((layers - theirs).norm() / theirs.norm()).item() < 1e-2, (rows, error)
            assert not space[0].any() and not space[1].any(), (launch, rows)


@pytest.mark.parametrize("in_features", [3584, 18944])
def test_the_rows_kernel_agrees_with_mslk_s_own_product(in_features):
    """mslk_rows (tensor cores with the weights, converted by inline asm, as the first operand)
    gives MSLK's product at 2-32 rows, in one share and in several, and leaves the workspace
    zeroed."""
    if reason := mslk_int4.unavailable_reason(torch.device("cuda"), torch.bfloat16):
        pytest.skip(reason)
    module = Int4WeightOnlyLinear(linear_layer(in_features), 128, kernel="mslk")
    assert mslk_int4.gemv_reads_layout(module.packed.device)
    weights = (module.packed, module.mslk_scales, module.mslk_zeros)
    space = mslk_gemv.workspace(mslk_gemv.MOST_ROWS, module.out_features, module.packed.device)
    for launch in (None, (64, 64, 1, 4, 3), (128, 128, 4, 4, 3), (256, 64, 0, 8, 3)):
        for rows in (2, 3, 8, 16, 20, 32):
            x = torch.randn(rows, in_features, dtype=torch.bfloat16, device="cuda")
            with torch.inference_mode():
                ours = mslk_rows.product(x, *weights, launch=launch, space=space).float()
                theirs = torch.ops.mslk.bf16i4bf16_shuffled(x, *weights).float()
            error = ((ours - theirs).norm() / theirs.norm()).item()
            assert error < 1e-2, (launch, rows, error)
            assert not space[0].any() and not space[1].any(), (launch, rows)


@pytest.mark.parametrize("in_features", [3584, 18944])
def test_the_int8_rows_kernel_gives_the_dequantized_product(in_features):
    """int8_rows over int8-wo's fragment-ordered copy (its inline asm) against x @ the
    dequantized weight at 1-32 rows, in one share and in several; the workspace left zeroed."""
    q, scales = quantize_int8(linear_layer(in_features).weight)
    packed = int8_rows.pack(q)
    weight = q.float() * scales.float()[:, None]
    space = mslk_gemv.workspace(mslk_gemv.MOST_ROWS, q.shape[0], q.device)
    for launch in (None, (64, 64, 1, 4, 3), (128, 128, 8, 4, 3), (256, 64, 2, 8, 3)):
        for rows in (1, 2, 8, 16, 20, 32):
            x = torch.randn(rows, in_features, dtype=torch.bfloat16, device="cuda")
            with torch.inference_mode():
                ours = int8_rows.product(x, packed, scales, launch=launch, space=space).float()
            expected = x.float() @ weight.T
            error = ((ours - expected).norm() / expected.norm()).item()
            assert error < 1e-2, (launch, rows, error)
            assert not space[0].any() and not space[1].any(), (launch, rows)


def test_mslk_s_preshuffle_is_read_as_one_permuted_atom():
    """Where each weight of a small matrix lands in MSLK's preshuffled copy, printed (-s) for
    the record and for a reader when the layout could not be fitted."""
    if reason := mslk_int4.unavailable_reason(torch.device("cuda"), torch.bfloat16):
        pytest.skip(reason)
    from model_utils.layers import mslk_layout

    def preshuffle(q, scales):
        return torch.ops.mslk.preshuffle_i4(mslk_int4.signed_nibbles(q), scales)[0]

    source = mslk_layout.sources(preshuffle, torch.device("cuda"))
    rows, cols = source // mslk_layout.PROBE_K, source % mslk_layout.PROBE_K
    print("first 512 nibbles hold (row, input):", list(zip(rows[:512].tolist(),
                                                            cols[:512].tolist())))
    layout = mslk_layout.fit(source)
    print(f"atom {layout.atom_n}x{layout.atom_k}, rows first {layout.rows_first}, "
          f"table {list(layout.table)}")


def test_gemlite_int4_dequantized_for_prompts_gives_the_same_product():
    """The quant candidate int4-wo-dequant-prompts: from 256 rows a gemlite int4 layer
    multiplies its weight dequantized to bf16 (gemlite's layout read by the compiled
    unpacking) by cuBLAS; eager and compiled, the product of the same stored weights."""
    module = layer("int4-gemlite")
    module.dequant_from_rows = 256
    weight = stored_weight("int4", module)
    assert_products(module, weight, (1, 255, 256, 1024), BOUND["int4-gemlite"])
    assert_products(torch.compile(module, dynamic=False), weight, (256, 1024),
                    BOUND["int4-gemlite"])
