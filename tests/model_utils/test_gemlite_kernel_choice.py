"""Which of gemlite's kernels multiplies a few rows (gemlite_weights.kernel_for_rows): int4 takes
the GEMV for one row only. gemlite itself asks the GPU when imported, so its rule is written out
here as gemlite 0.6 has it (tests/gpu/test_weight_kernels.py checks the real one, patched)."""

from model_utils.layers.gemlite_weights import kernel_for_rows


def gemlite_06_choice(batch_size: int, W_nbits: int, mx_dtype: bool = False) -> str:  # noqa: N803
    if batch_size >= 64:
        return "GEMM"
    if batch_size > (4 if W_nbits < 8 and not mx_dtype else 2):
        return "GEMM_SPLITK"
    return "GEMV_REVSPLITK" if W_nbits < 8 else "GEMV_SPLITK"


def test_int4_takes_the_gemv_for_one_row_and_split_k_from_two():
    choice = kernel_for_rows(gemlite_06_choice)
    assert [choice(rows, 4) for rows in (1, 2, 3, 4, 5, 63, 64)] == [
        "GEMV_REVSPLITK", "GEMM_SPLITK", "GEMM_SPLITK", "GEMM_SPLITK", "GEMM_SPLITK",
        "GEMM_SPLITK", "GEMM"]


def test_8_bit_weights_and_mx_formats_keep_gemlites_choice():
    choice = kernel_for_rows(gemlite_06_choice)
    for rows in (1, 2, 3, 4, 8, 64):
        assert choice(rows, 8) == gemlite_06_choice(rows, 8)
        assert choice(rows, 4, True) == gemlite_06_choice(rows, 4, True)


def test_wrapping_twice_changes_nothing():
    once = kernel_for_rows(gemlite_06_choice)
    assert kernel_for_rows(once) is once
