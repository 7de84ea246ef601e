"""At load, gemlite's kernel for each weight shape the model hands it is launched once at
every row bucket it will serve and its product held to the weights' own numbers, eagerly,
before torch.compile and the CUDA graphs meet it (check_kernels): a config that does not fit
the GPU is tuned anew, and a kernel that fails or computes other numbers leaves the shape to
another path. The kernels themselves and gemlite's tables: gemlite_weights."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from . import gemlite_borrowed
from .gemlite_weights import GEMLITE_BELOW_ROWS, config_signature, product, tuned_config

log = logging.getLogger(__name__)

# int4 layers in gemlite's layout take its GEMM for prompts as well: the load checks it at
# the prompt row counts that are powers of two up to this many (those of the prefill graphs,
# which compile their kernels at load anyway; one kernel serves every size).
CHECKED_PROMPT_ROWS = 1024


def _is_int4(layer: nn.Module) -> bool:
    """An int4 layer packed in gemlite's layout: gemlite's kernels are its only path."""
    return getattr(layer, "kernel", None) == "gemlite"


class KernelFailure(RuntimeError):
    """gemlite's kernel failed for layers that have no other path (int4 in its layout)."""


def check_kernels(model: nn.Module, weight_rows: WeightRows | None = None) -> list[str]:
    """Run gemlite's kernel once at every row bucket it serves that has a tuned config (below
    GEMLITE_BELOW_ROWS; for int4, which it serves at every row count, at prompts' powers of two
    up to CHECKED_PROMPT_ROWS too), for each weight shape and type the model handed it,
    eagerly, before torch.compile and the CUDA graphs meet it.

    Why: gemlite keys a tuned config by the matrix shape, the row bucket and the input type,
    not the weight's type, so the config tuned for e4m3 weights of a shape is handed to int8
    weights of that shape too, and the int8 kernel can need more shared memory than the GPU has
    (on an H200, 344 KB against 227 KB: BENCHMARKS.md). A config that does not launch is
    forgotten and the shape tuned anew (gemlite's own tuning keeps to the GPU's limits); a
    shape whose kernel still fails leaves gemlite, its 8-bit layers keeping their own path
    (int4 layers in gemlite's layout have none: KernelFailure, for the caller to pack them
    for another kernel while it still has their weights).
    A kernel that runs but gives other numbers than the weights' fails too: each launch
    multiplies random rows and is held to the product of the same weights dequantized (the
    8-bit layers' own; for an int4 layer `weight_rows`: its weight at the given output
    features from the numbers before packing, a reference apart from the packed layout that
    the kernel reads).
    Returns one line for each repair or removal (empty when every kernel ran)."""
    from triton.runtime.errors import OutOfResources

    shapes: dict[tuple, list[nn.Module]] = {}
    for module in model.modules():
        if getattr(module, "gemlite_meta", None) is not None:
            key = (module.out_features, module.in_features, module.gemlite_weight().dtype)
            shapes.setdefault(key, []).append(module)
    done = []
    for (n, k, dtype), layers in shapes.items():
        device = layers[0].gemlite_weight().device
        # The weights every launch of this shape is held to, read once.
        outputs = checked_outputs(n, device)
        with torch.inference_mode():
            weight = checked_weight(layers[0], outputs, weight_rows)
        # Only the buckets with a config in gemlite's table: one it tunes here keeps to the
        # GPU's limits, and tuning buckets the engine never runs would cost seconds each.
        served = CHECKED_PROMPT_ROWS + 1 if _is_int4(layers[0]) else GEMLITE_BELOW_ROWS
        for first, last in _row_buckets(layers[0], served):
            rows = first if first < GEMLITE_BELOW_ROWS else last  # prompts: the bucket's top
            if rows >= GEMLITE_BELOW_ROWS and rows & (rows - 1):
                continue  # a prompt bucket no prefill graph has (97-128 rows is checked at 128)
            if not tuned_config(layers[0], rows):
                continue
            x2 = torch.randn(rows, k, dtype=torch.bfloat16, device=device,
                             generator=torch.Generator(device=device).manual_seed(rows))
            failure = check_launch(layers[0], x2, outputs, weight)
            lent = failure is not None and _borrowed(layers[0], rows)
            if isinstance(failure, OutOfResources) or (lent and not isinstance(failure, (
                    torch.OutOfMemoryError, torch.AcceleratorError))):
                forget_tuned(layers[0], rows)
                what = "borrowed from another shape" if lent else "tuned"
                done.append(f"gemlite's {what} config for {n}x{k} {dtype} at "
                            f"{_rows_of(first, last)} failed on this GPU "
                            f"({type(failure).__name__}: {failure}); tuned anew")
                failure = check_launch(layers[0], x2, outputs, weight)
            if isinstance(failure, (torch.OutOfMemoryError, torch.AcceleratorError)):
                raise failure  # the device's state: no other kernel would do better
            if failure is not None and _is_int4(layers[0]):
                for line in done:
                    log.warning(line)
                raise KernelFailure(f"gemlite's int4 kernel failed for {n}x{k} at "
                                    f"{_rows_of(first, last)}: {type(failure).__name__}: "
                                    f"{failure}") from failure
            if failure is not None:  # the layers' own path serves them instead
                for layer in layers:
                    layer.gemlite_meta = None
                done.append(f"gemlite left {len(layers)} layers of {n}x{k} {dtype}: its kernel "
                            f"failed at {_rows_of(first, last)} ({type(failure).__name__}: "
                            f"{failure})")
                break
    for line in done:
        log.warning(line)
    return done


class WrongProduct(RuntimeError):
    """gemlite's kernel ran and gave numbers other than the product of the layer's weights."""


# How far a kernel's product of random rows may be from the same weights' dequantized product,
# as a fraction of its norm: both round to bf16 (split-K adds its parts in fp32:
# gemlite_weights) for well under 1e-2; a misread layout or shift is off by the product's own
# size, and sums rounded in bf16 as they build were off by a few percent.
PRODUCT_BOUND = 0.02
# The same for any one input row or output feature, against a typical one's size: a misread
# confined to one tile of the output moves the whole product's norm by a few percent only.
SLICE_BOUND = 0.2
# Output features compared, spread evenly over the layer so that every tile of the kernel's
# has its share, without a dequantized copy of a whole weight on the GPU.
CHECKED_OUTPUTS = 512
# The dequantized weight of a layer at some of its output features: rows -> [len(rows), K].
WeightRows = Callable[[torch.Tensor], torch.Tensor]


def check_launch(layer: nn.Module, x2: torch.Tensor, outputs: torch.Tensor,
                 weight: torch.Tensor | None) -> Exception | None:
    """Run the layer's gemlite product of x2 once: None, what the kernel raised, or
    WrongProduct, its output features `outputs` held to x2 times `weight` (the layer's
    weights dequantized at those features, checked_weight; None: not held to anything)."""
    with torch.inference_mode():
        try:
            got = product(layer, x2)
            torch.cuda.synchronize(x2.device)
        except Exception as error:  # noqa: BLE001 - the caller decides: tune again or leave
            return error
        if weight is None:
            return None
        return off_product(got[:, outputs].float(), x2.float() @ weight.T)


def checked_outputs(out_features: int, device: torch.device) -> torch.Tensor:
    """The indices of the output features a launch is checked at (CHECKED_OUTPUTS of them)."""
    count = min(out_features, CHECKED_OUTPUTS)
    return torch.linspace(0, out_features - 1, count, device=device).round().long().unique()


def checked_weight(layer: nn.Module, outputs: torch.Tensor,
                   weight_rows: WeightRows | None = None) -> torch.Tensor | None:
    """The layer's weights dequantized at the output features `outputs`, fp32 [len, K]: from
    `weight_rows` where given, else from an 8-bit layer's own weights (w = q * scale per row);
    None for an int4 layer without `weight_rows` (its reference is kept apart from its packed
    layout)."""
    if weight_rows is not None:
        return weight_rows(outputs).float()
    if not hasattr(layer, "qweight"):
        return None
    # Rows taken as bytes: indexing is not implemented for every 8-bit type.
    q = layer.qweight.view(torch.uint8)[outputs].view(layer.qweight.dtype)
    return q.float() * layer.scales[outputs].float().unsqueeze(-1)


def off_product(got: torch.Tensor, expected: torch.Tensor) -> WrongProduct | None:
    """WrongProduct when `got` [M, C] is further than PRODUCT_BOUND from `expected` as a whole,
    or than SLICE_BOUND in any one row or column (or is not finite)."""
    difference, size = got - expected, expected.norm().clamp(min=1e-30)
    error = (difference.norm() / size).item()
    # Each column's (dim 0) and row's (dim 1) error against a typical one's norm: the whole
    # norm over the square root of how many there are.
    worst = max((difference.norm(dim=dim).max() * expected.shape[1 - dim] ** 0.5 / size).item()
                for dim in (0, 1))
    if error <= PRODUCT_BOUND and worst <= SLICE_BOUND:  # False for a NaN as well
        return None
    return WrongProduct(f"its product of random rows is {error:.3g} of the weights' own away, "
                        f"{worst:.3g} in its worst row or column (at most {PRODUCT_BOUND} and "
                        f"{SLICE_BOUND})")


def _rows_of(first: int, last: int) -> str:
    """A bucket's row counts ("5-8 rows")."""
    if last > first:
        return f"{first}-{last} rows"
    return "1 row" if first == 1 else f"{first} rows"


def _row_buckets(layer: nn.Module, below: int) -> list[tuple[int, int]]:
    """(smallest, largest) row count of each of gemlite's row buckets for this layer below
    `below`: its configs are kept per kernel type and bucket, so one launch stands for every
    count in it (a bucket that two kernel types share, 49-64 rows for split-K and the GEMM
    from 64, is two)."""
    import gemlite.core as core
    from gemlite.triton_kernels import utils

    buckets: dict[tuple, list[int]] = {}
    for rows in range(1, below):
        key = (core.get_matmul_type(rows, layer.gemlite_meta[1]), utils.get_closest_m(rows))
        buckets.setdefault(key, [rows, rows])[1] = rows
    return sorted(tuple(span) for span in buckets.values())


def _borrowed(layer: nn.Module, rows: int) -> bool:
    """Whether the config gemlite holds for this layer at `rows` rows was borrowed from another
    shape (gemlite_borrowed): a guess, tuned for this shape when it fails."""
    matmul_type, bucket, shape = config_signature(layer, rows)
    return (matmul_type, str((bucket, *shape))) in gemlite_borrowed.BORROWED


def forget_tuned(layer: nn.Module, rows: int) -> None:
    """Drop the config gemlite holds for this layer's shape at `rows` rows, from its table of
    tuned configs and from the Triton autotuner's choices, so that the next launch tunes."""
    import gemlite.core as core
    from gemlite.triton_kernels import utils

    matmul_type, bucket, shape = config_signature(layer, rows)
    # gemlite's table has no weight type (the other type's layers tune again if they need it);
    # Triton's autotuner keys carry every tensor argument's dtype: only this type's go.
    core.GEMLITE_TRITON_CONFIG_CACHE.get(matmul_type, {}).pop(str((bucket, *shape)), None)
    gemlite_borrowed.BORROWED.discard((matmul_type, str((bucket, *shape))))  # tuned for real
    weight_type = str(layer.gemlite_weight().dtype)
    for kernel in core.GEMLITE_TRITON_MAPPING[matmul_type].kernel:
        for key in [key for key in kernel.cache
                    if tuple(key[1:6]) == shape and utils.get_closest_m(key[0]) == bucket
                    and weight_type in key]:
            del kernel.cache[key]
