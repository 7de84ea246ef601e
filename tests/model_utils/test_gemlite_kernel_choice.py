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


# -- the first launch of a config gemlite's table holds (gemlite_weights.untime_lone_configs) ----
class Launches:
    """Stands in for the compiled kernel behind a real Triton autotuner: records each launch's
    meta-parameters (a CPU has no GPU to launch on)."""

    def __init__(self):
        self.blocks = []

    def run(self, *args, BLOCK, **kwargs):  # noqa: N803 - Triton's meta name
        self.blocks.append(BLOCK)


def autotuner(pruned_to: int, timings: list):
    """A real Triton autotuner over two configs, pruned to the first `pruned_to` of them; its
    timing function (Triton's do_bench hook) records each config it is asked to time, the
    second timed faster; its kernel records launches instead of launching."""
    import triton

    def kernel(x, BLOCK: "triton.language.constexpr"):  # noqa: N803 - Triton's meta name
        pass

    configs = [triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})]

    def timed(call, quantiles):
        timings.append(call)
        return [float(3 - len(timings))] * 3

    tuner = triton.autotune(configs=configs, key=[], do_bench=timed, prune_configs_by={
        "early_config_prune": lambda found, nargs, **kw: found[:pruned_to]})(triton.jit(kernel))
    tuner.fn = Launches()
    return tuner


def test_a_lone_config_left_by_pruning_is_launched_untimed():
    from model_utils.layers.gemlite_weights import untime_lone_configs

    timings = []
    tuner = autotuner(1, timings)
    untime_lone_configs(tuner)
    tuner.run(None)
    tuner.run(None)  # chosen once for the key
    assert tuner.fn.blocks == [16, 16]
    assert timings == []


def test_configs_left_to_choose_among_are_timed_as_before():
    from model_utils.layers.gemlite_weights import untime_lone_configs

    timings = []
    tuner = autotuner(2, timings)
    untime_lone_configs(tuner)
    wrapped = tuner._bench
    untime_lone_configs(tuner)  # once only
    assert tuner._bench is wrapped
    tuner.run(None)
    assert len(timings) == 2 and tuner.fn.blocks == [32]  # the faster one


def test_without_the_change_triton_times_a_lone_config():
    """What the wrapper is for: Triton's own autotuner times a lone config before launching."""
    timings = []
    tuner = autotuner(1, timings)
    tuner.run(None)
    assert len(timings) == 1 and tuner.fn.blocks == [16]
