"""gemlite's Triton kernels for the app's quantized weights (int8-wo, fp8, int4-wo) on a GPU.

A decode step multiplies a few rows by every weight: the time goes to reading the weights, and
an 8-bit weight read at the memory's speed halves bf16's step. Neither of the app's own 8-bit
paths does that: inductor's reduction over int8 reached bf16's speed, no better, and fp8's
torch._scaled_mm runs a 128x128 tile for a one-row input (BENCHMARKS.md, "Modes and
quantization"). gemlite (PyPI; pure Python and Triton) ships a weight-only GEMV for the fewest rows
(1-2 for 8-bit weights; for int4 one row here, kernel_for_rows), a split-K GEMM up to 64 and a
GEMM beyond, as one custom op that torch.compile and CUDA graphs take.

8-bit (attach): gemlite's layout is the app's own, the [N, K] int8 or e4m3 weight read through
its transpose (a view), one scale per output row. So a layer keeps its one weight tensor and
gains a few small ones (the scales as gemlite reads them, its metadata); no copy of the weights
is made. Only decode rows take it (fewer than GEMLITE_BELOW_ROWS): prompts keep each layer's
own path, whose speed reading weights matters less.

4-bit (pack_int4): gemlite packs the int4 numbers into its own layout (eight to an int32 word
along K), which its kernels read (and int4_weight reads back), so they serve every row count,
prompts included: the layer's one copy of the weights. They replace PyTorch's tinygemm, which
keeps up for one row but not for a batch or a prompt (BENCHMARKS.md, "fp8 and gemlite's int4").

gemlite tunes each matrix shape and row count at its first use (tens of seconds each) unless a
tuned config is known: gemlite ships the H100's, this app the H200's and the H100's for the
shapes measured (gemlite_configs/, added to gemlite's own), and what a load tunes is kept
beside torch.compile's cache (save_tuned), so it is tuned once. A load borrows the configs of
the nearest tuned shape for a shape that has none (borrow_configs, gemlite_borrowed), so that
it does not tune for minutes. (gemlite keys a config by shape, rows and input type, not the
weight's type: int8 and fp8 weights of a shape share one; gemlite_checks.check_kernels repairs
one that does not fit.)

Its split-K kernels add partial sums atomically, in an order that varies from run to run: the
same greedy reply in a quantized mode may part at a near-tie between runs (the logprob checks,
not equal tokens, are what the tests hold it to).
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import torch
from torch import nn

from . import gemlite_borrowed

log = logging.getLogger(__name__)

CONFIGS = Path(__file__).with_name("gemlite_configs")
# Rows below this multiply through gemlite (its GEMV for the fewest, split-K GEMM above): every
# decode batch the engine captures (up to 32 rows, plus a next turn's tail rows).
GEMLITE_BELOW_ROWS = 64


def unavailable_reason(device: torch.device, compute_dtype: torch.dtype) -> str | None:
    """Why gemlite's kernels cannot serve quantized layers here, or None when they can."""
    if device.type != "cuda":
        return "gemlite's kernels are for CUDA GPUs"
    if compute_dtype != torch.bfloat16:  # fp16 inputs times int8 may overflow before scaling
        return f"gemlite is used with bf16 inputs, not {compute_dtype}"
    return _import_problem()


@functools.cache
def _import_problem() -> str | None:
    # Imported here, never at module import: gemlite asks the GPU when imported.
    try:
        import gemlite.core
        import gemlite.helper  # noqa: F401
    except Exception as error:  # noqa: BLE001 - not installed, or Triton finding no GPU
        return f"gemlite is not available ({type(error).__name__}: {error})"
    # Split-K kernels add their partial sums atomically into the output. In bf16 each addition
    # rounds to 8 bits: int4's GEMV, whose shipped configs split K in blocks of 8 to 32, then
    # missed the product by up to 4% (18944 input features). fp32 sums, one cast at the end.
    gemlite.core.set_native_atomic_bfp16(False)
    gemlite.core.get_matmul_type = kernel_for_rows(gemlite.core.get_matmul_type)
    for kernels in gemlite.core.GEMLITE_TRITON_MAPPING.values():
        found = kernels.kernel  # a list of autotuners a matmul type (one, in some versions)
        for kernel in found if isinstance(found, (list, tuple)) else [found]:
            untime_lone_configs(kernel)
    _load_configs()
    return None


def untime_lone_configs(autotuner) -> None:
    """Let a Triton autotuner launch the one config its pruning leaves without timing it
    first. Triton times every config left after pruning, even a lone one, at each kernel's
    first launch for a shape in a process (about a tenth of a second each: its timing loop);
    gemlite prunes to the one config its table holds, so a load that launched a dozen row
    buckets of four weight shapes spent seconds choosing among one (BENCHMARKS.md, "int4-wo
    on the H200 at the new defaults"). Where pruning leaves several, they are timed as before
    (gemlite tuning a shape it has no config for). Anything but an autotuner, or one of a
    Triton without the timing step this wraps, is left alone."""
    import threading

    from triton.runtime.autotuner import Autotuner

    if (not isinstance(autotuner, Autotuner) or not hasattr(autotuner, "_bench")
            or getattr(autotuner, "lone_config_untimed", False)):
        return
    prune, timing = autotuner.prune_configs, autotuner._bench
    left = threading.local()  # how many configs this thread's last pruning left

    def counted_prune(kwargs):
        configs = prune(kwargs)
        left.configs = len(configs)
        return configs

    def timed(*args, config, **meta):
        if getattr(left, "configs", 0) == 1:
            return [0.0, 0.0, 0.0]  # the median and quantiles Triton compares: nothing to beat
        return timing(*args, config=config, **meta)

    autotuner.prune_configs, autotuner._bench = counted_prune, timed
    autotuner.lone_config_untimed = True


def kernel_for_rows(gemlite_choice):
    """gemlite's choice of kernel by row count, but int4 at 2-4 rows through its split-K GEMM
    instead of its GEMV. The GEMV unpacks the weights again for each row: on the 7B shape the
    int4 step grew with every row from one to four, past bf16's and past int4's own step at
    eight rows, where the split-K GEMM runs (BENCHMARKS.md, "int4-wo as the app loads it").
    gemlite ships split-K configs tuned for 2 and 4 rows. Set as gemlite's own function, which
    its custom op calls at run time, so that a step compiled for a symbolic row count takes no
    guard on it."""
    if getattr(gemlite_choice, "int4_split_k_from_two_rows", False):
        return gemlite_choice

    def choice(batch_size: int, W_nbits: int, mx_dtype: bool = False) -> str:  # noqa: N803
        if W_nbits < 8 and not mx_dtype and 1 < batch_size <= 4:
            return "GEMM_SPLITK"
        return gemlite_choice(batch_size, W_nbits, mx_dtype)

    choice.int4_split_k_from_two_rows = True
    return choice


def _tuned_file() -> Path | None:
    """Where this GPU's tuned configs are kept: beside torch.compile's cache, None without one."""
    import os

    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")  # the app points it at its own folder
    if not folder:
        return None
    gpu = "".join(c if c.isalnum() else "-" for c in torch.cuda.get_device_name())
    return Path(folder) / f"gemlite-{gpu}.json"


def shipped_configs(device_name: str) -> Path | None:
    """The configs this app ships for a GPU (tuned on one like it), None for other GPUs."""
    for tag in ("H200", "H100"):
        if tag in device_name:
            path = CONFIGS / f"{tag.lower()}.json"
            return path if path.exists() else None
    return None


def _load_configs() -> None:
    """The tuned configs of this GPU: the shipped ones, then what earlier loads tuned."""
    import gemlite.core as core

    name = torch.cuda.get_device_name()
    sources = []
    if core.selected_tag is not None:  # gemlite loaded its own for this GPU at import
        sources.append(f"gemlite's ({core.selected_tag})")
    shipped = shipped_configs(name)
    if shipped is not None:
        core.GemLiteLinear.load_config(str(shipped))
        sources.append(str(shipped))
    kept = _tuned_file()
    if kept is not None and kept.exists():
        core.GemLiteLinear.load_config(str(kept), print_error=False)
        sources.append(str(kept))
    log.info("gemlite on %s: tuned configs from %s", name, ", ".join(sources) or "none")


def save_tuned(model: nn.Module) -> None:
    """Keep what gemlite tuned in this process (with what the file had) for later loads; only
    after a load whose layers use gemlite (a bf16 load tuned nothing to keep)."""
    import sys

    if "gemlite.core" not in sys.modules or not any(
            getattr(m, "gemlite_meta", None) is not None for m in model.modules()):
        return
    kept = _tuned_file()
    if kept is None:
        return
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        sys.modules["gemlite.core"].GemLiteLinear.cache_config(str(kept))
        if gemlite_borrowed.BORROWED:  # guesses, not tunings: the next load borrows again
            table = json.loads(kept.read_text())
            for matmul_type, key in gemlite_borrowed.BORROWED:
                table.get(matmul_type, {}).pop(key, None)
            kept.write_text(json.dumps(table))
    except Exception as error:  # noqa: BLE001 - not kept costs tuning again, nothing more
        log.warning("gemlite's tuned configs not kept in %s: %s", kept, error)


def attach(layer: nn.Module) -> bool:
    """Give an 8-bit layer (`qweight` [N, K] int8 or e4m3, `scales` [N]) gemlite's view of it:
    the scales as a [1, N] row, the empty zero points and the metadata gemlite's op takes.
    Sets layer.gemlite_meta (None until then: the layer's own path runs). False, the layer
    left as it was, for a shape gemlite does not take (input features a multiple of 32)."""
    from gemlite.core import GemLiteLinearTriton
    from gemlite.helper import A16W8_FP8, A16W8_INT8

    if layer.in_features % GemLiteLinearTriton.MIN_SIZE:
        return False

    dtype = torch.bfloat16 if layer.scales.dtype == torch.float32 else layer.scales.dtype
    kind = A16W8_FP8 if layer.qweight.dtype == torch.float8_e4m3fn else A16W8_INT8
    packed = kind(device=layer.qweight.device, dtype=dtype).from_weights(
        layer.qweight, scales=layer.scales.unsqueeze(1))
    # gemlite reads the weight through its transpose, the same storage: check, not assume.
    if packed.W_q.data_ptr() != layer.qweight.data_ptr():
        raise RuntimeError("gemlite made a copy of an 8-bit weight")
    _adopt(layer, packed)
    return True


def pack_int4(layer: nn.Module, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              group: int) -> torch.Tensor:
    """gemlite's packing of int4 numbers (q uint8 [N, K] in 0..15; bf16 scales and zeros
    [N, K/group], w = (q - 8) * scale + zero, int_quantization.quantize_int4) for `layer`, on q's
    device: returns the packed weight (the layer's one copy, for it to keep) and gives the
    layer gemlite's scales, zeros and metadata (as attach does)."""
    from gemlite.helper import A16Wn

    n, k = q.shape
    if group == k:  # one group a row reads as per-row scales to gemlite (its mode 3, no
        # shift): the same numbers as two groups of half the width, each with the row's pair
        scales, zeros, group = (scales.repeat_interleave(2, 1), zeros.repeat_interleave(2, 1),
                                group // 2)
    # gemlite reads w = q * scale + shift (its "fma" mode: W_group_mode 4) with the shift
    # computed from a zero point in q's units; the app's own shift, zero - 8 * scale, rounded
    # to bf16 once, replaces it below, so that no second rounding parts the two.
    zero_in_steps = 8 - zeros.float() / scales.float()
    packed = A16Wn(device=q.device, dtype=torch.bfloat16).from_weights(
        q, scales, zero_in_steps, 4, group)
    shift = (zeros.float() - 8 * scales.float()).to(torch.bfloat16).view(n, -1).t()
    if packed.W_group_mode != 4 or packed.zeros.shape != shift.shape:
        raise RuntimeError(f"gemlite packed int4 in an unexpected form (W_group_mode "
                           f"{packed.W_group_mode}, shifts {tuple(packed.zeros.shape)})")
    packed.zeros.data.copy_(shift)
    _adopt(layer, packed, own=True)
    return packed.W_q.detach()


def int4_weight(packed: torch.Tensor, scales: torch.Tensor, shifts: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """The [K, N] weight that gemlite's int4 layout holds: packed [K/8, N] int32, element k of
    a column in word k // 8 at bit 4 * (k % 8) (its pack_weights_over_cols); w = q * scale +
    shift per group of rows (scales, shifts [K/group, N]: W_group_mode 4, see pack_int4)."""
    words, n = packed.shape
    bits = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32).view(1, 8, 1)
    q = (packed.unsqueeze(1) >> bits) & 15  # [K/8, 8, N]: the rows of each word in order
    groups = scales.shape[0]
    q = q.reshape(groups, words * 8 // groups, n).to(dtype)
    return (q * scales.to(dtype).unsqueeze(1) + shifts.to(dtype).unsqueeze(1)).reshape(-1, n)


@functools.cache
def _compiled_int4_weight():
    # Unfused, the unpacking writes int32 temporaries twice the bf16 weight's size (8x the
    # packed one); compiled, it is one kernel that reads the packed words and writes the
    # weight. Sizes dynamic from the start: one compile for all of a model's shapes a dtype.
    return torch.compile(int4_weight, dynamic=True, fullgraph=True)


def dequantized_int4(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """An int4 layer's weight in gemlite's layout as a new [K, N] tensor of `dtype`."""
    weight = _compiled_int4_weight() if layer.packed.is_cuda else int4_weight
    return weight(layer.packed, layer.gemlite_scales, layer.gemlite_zeros, dtype)


def _adopt(layer: nn.Module, packed: nn.Module, *, own: bool = False) -> None:
    """The small tensors and the metadata of gemlite's packed layer, kept by the app's layer
    (not gemlite's module, which would hold a second reference to the weight). `own`: they
    are the layer's only copy of its scales (int4), saved with its state; the 8-bit layers
    keep their own scales beside these views."""
    layer.register_buffer("gemlite_scales", packed.scales.detach(), persistent=own)
    layer.register_buffer("gemlite_zeros", packed.zeros.detach(), persistent=own)
    layer.register_buffer("gemlite_meta_scale", packed.meta_scale.detach(), persistent=own)
    layer.gemlite_meta = [int(v) for v in packed.get_meta_args()]


def borrow_configs(layer: nn.Module) -> int:
    """Configs for this layer's shape from the nearest tuned shapes where gemlite's table has
    none (gemlite_borrowed), before its kernels are first launched: how many."""
    import gemlite.core as core

    _, _, shape = config_signature(layer, 1)
    return len(gemlite_borrowed.borrow(core.GEMLITE_TRITON_CONFIG_CACHE, shape))


def borrowed_shapes(model: nn.Module) -> list[str]:
    """The weight shapes gemlite serves in this model with configs borrowed in this process."""
    shapes = {gemlite_borrowed.parse_key(key)[1:] for _, key in gemlite_borrowed.BORROWED}
    return sorted({f"{m.out_features}x{m.in_features}" for m in model.modules()
                   if getattr(m, "gemlite_meta", None) is not None
                   and config_signature(m, 1)[2] in shapes})


def untuned_shapes(model: nn.Module) -> list[str]:
    """The weight shapes gemlite serves in this model that have no tuned config for one row
    on this GPU (neither shipped nor kept from an earlier load): gemlite tunes each of their
    row buckets at its first use, tens of seconds each, once (save_tuned keeps them)."""
    shapes = {}
    for module in model.modules():
        if getattr(module, "gemlite_meta", None) is not None:
            shapes.setdefault((module.out_features, module.in_features), module)
    return [f"{n}x{k}" for (n, k), layer in shapes.items() if not tuned_config(layer, 1)]


def config_signature(layer: nn.Module, rows: int) -> tuple[str, int, tuple]:
    """How gemlite files this layer's config at `rows` rows: its kernel type, the row bucket
    and (out features, in features, group size, elements per sample, type id)."""
    import gemlite.core as core
    from gemlite.triton_kernels import utils

    meta = layer.gemlite_meta  # gemlite's get_meta_args(): [.., W_nbits, group_size, ..,
    # elements_per_sample, input_dtype, ..]; its type_id counts bf16 inputs as fp16 ones
    input_dtype = 1 if meta[5] == 2 else meta[5]
    shape = (layer.out_features, layer.in_features, meta[2], meta[4], input_dtype * 100 + meta[1])
    return core.get_matmul_type(rows, meta[1]), utils.get_closest_m(rows), shape


def tuned_config(layer: nn.Module, rows: int) -> dict | None:
    """The config gemlite's table holds for this layer at `rows` rows (None: it would tune)."""
    import gemlite.core as core

    matmul_type, bucket, shape = config_signature(layer, rows)
    return core.GEMLITE_TRITON_CONFIG_CACHE.get(matmul_type, {}).get(str((bucket, *shape)))


def takes(layer: nn.Module, x2: torch.Tensor) -> bool:
    """Whether gemlite multiplies the input rows x2 [M, K] for this layer: bf16 rows, fewer
    than the limit (a static shape: decided when torch.compile traces or a graph is captured).
    `layer.gemlite_below_rows`, where set, moves the limit (the benchmark's candidates try
    gemlite's GEMM for prompts too)."""
    if getattr(layer, "gemlite_meta", None) is None or x2.dtype != torch.bfloat16:
        return False
    return x2.shape[0] < getattr(layer, "gemlite_below_rows", GEMLITE_BELOW_ROWS)


def product(layer: nn.Module, x2: torch.Tensor) -> torch.Tensor:
    """x2 [M, K] @ the layer's dequantized weight.T, by gemlite's kernel for M rows."""
    return torch.ops.gemlite.forward_functional(
        x2, None, [layer.gemlite_weight(), layer.gemlite_scales, layer.gemlite_zeros,
                   layer.gemlite_meta_scale], layer.gemlite_meta, -1)
