"""Weight-only int8 and int4 quantization, done by the app at load from a bf16 checkpoint.

Decoding one token is a matrix-vector product per layer: the GPU's time goes to reading the
weights, so weights stored in 8 or 4 bits are read 2x or 4x faster, if the dequantization is
fused into the product instead of writing a bf16 copy first (what made bitsandbytes' int8 and
torchao's defaults slower than bf16, BENCHMARKS.md). Here:

- int4: asymmetric, one bf16 scale and one bf16 zero point per `group` weights of a row, the
  scheme of PyTorch's own tinygemm kernel (torch.ops.aten._weight_int4pack_mm, the kernel of
  gpt-fast and of torchao's int4 "tile_packed_to_4d"): w = (q - 8) * scale + zero, q in 0..15;
  each group's range is its min-max or a few clippings of it, whichever rounds it with the
  least squared error (int_quantization.INT4_RANGE_FRACTIONS).
  On a CUDA GPU with bf16 compute the weights are kept in the packed layout of the kernel that
  multiplies them (INT4_KERNELS, the first that runs), and every forward is one call of that
  kernel, eager, compiled or captured alike.
  Elsewhere (the CPU, other compute dtypes) they are kept two to a byte and dequantized in the
  forward: slow, but the same numbers, which is what the tests compare.
- int8: symmetric, one bf16 scale per output row: w = q * scale, q in -127..127. The forward is
  linear(x, q.to(x.dtype)) * scale; compiled for one row, inductor turns that into one reduction
  that reads the int8 weights once (with coordinate-descent tuning, see inductor_options). On a
  GPU with gemlite installed, decode rows go through gemlite's kernels instead (gemlite_weights).

Loading never holds two copies of the model on the GPU: the bf16 checkpoint is read into CPU
memory and each Linear is moved to the device, quantized there and its bf16 weight dropped, one
at a time. lm_head stays in the compute dtype (as bitsandbytes leaves it).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from . import fp8_weights, gemlite_checks, gemlite_weights, mslk_int4
from .decode_fusions import fuse_for_decoding
from .fp8_weights import Fp8Linear
from .int_quantization import (
    dequantize_int4,
    pack_nibbles,
    quantize_int4,
    quantize_int8,
    unpack_nibbles,
)

log = logging.getLogger(__name__)

INT4_INNER_K_TILES = 8  # tinygemm's packing: in_features must be a multiple of 16 x this
TINYGEMM_K_MULTIPLE = 16 * INT4_INNER_K_TILES
TINYGEMM_N_MULTIPLE = 8
# How int4 weights are kept and multiplied: MSLK's CUTLASS kernel and a GEMV of the app's for a
# reply's row (Hopper, where mslk-cuda loads: faster than gemlite's at every load, BENCHMARKS.md),
# gemlite's Triton kernels, PyTorch's tinygemm (slow for batches and prompts), or dequantized.
INT4_KERNELS = ("mslk", "gemlite", "tinygemm", "dequantize")


# -- the layers ----------------------------------------------------------------------------------
class Int4WeightOnlyLinear(nn.Module):
    """A Linear whose weight is int4 with per-group scales and zero points (see module doc),
    kept in the layout of the kernel that multiplies it (INT4_KERNELS)."""

    gemlite_meta = None  # set by gemlite_weights.pack_int4 for the "gemlite" kernel
    dequant_from_rows = 1 << 30  # gemlite: from so many rows, dequantized + cuBLAS (a candidate)

    def __init__(self, linear: nn.Linear, group: int, *, kernel: str):
        super().__init__()
        if kernel not in INT4_KERNELS:
            raise ValueError(f"int4 kernel {kernel!r}: one of {', '.join(INT4_KERNELS)}")
        self.in_features, self.out_features, self.group = (linear.in_features,
                                                           linear.out_features, group)
        q, scales, zeros = quantize_int4(linear.weight, group)
        self.kernel = kernel
        if kernel == "mslk":
            packed, scales, zeros = mslk_int4.pack(q, scales, zeros)
            self.register_buffer("packed", packed)
            self.register_buffer("mslk_scales", scales)
            self.register_buffer("mslk_zeros", zeros)
            mslk_int4.keep_gemv(self, packed)  # the rows its GEMV serves, its workspace
        elif kernel == "gemlite":
            self.register_buffer("packed", gemlite_weights.pack_int4(self, q, scales, zeros,
                                                                     group))
        elif kernel == "tinygemm":
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack(
                pack_nibbles(q), INT4_INNER_K_TILES))
            # [K/group, N, 2]: what the kernel reads
            self.register_buffer("scales_and_zeros",
                                 torch.stack([scales, zeros], -1).transpose(0, 1).contiguous())
        else:
            self.register_buffer("packed", pack_nibbles(q))
            self.register_buffer("scales", scales)
            self.register_buffer("zeros", zeros)
        self.bias = linear.bias

    def gemlite_weight(self) -> torch.Tensor:
        return self.packed  # gemlite's own layout, [K/8, N] int32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "dequantize":
            return F.linear(x, self.dequantized(x.dtype), self.bias)
        x2 = x.reshape(-1, self.in_features).contiguous()
        if self.kernel == "mslk":
            y = mslk_int4.layer_product(self, x2)
        elif self.kernel == "gemlite" and x2.shape[0] >= self.dequant_from_rows:
            y = x2 @ gemlite_weights.dequantized_int4(self, x2.dtype)
        elif self.kernel == "gemlite":
            y = gemlite_weights.product(self, x2)
        else:
            y = torch.ops.aten._weight_int4pack_mm(x2, self.packed, self.group,
                                                   self.scales_and_zeros)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    @property
    def readable(self) -> bool:
        """Whether dequantized() can read the weights (tinygemm's layout: its kernel only)."""
        return self.kernel != "tinygemm"

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        if not self.readable:
            raise NotImplementedError(f"{self.kernel}'s packed layout is read by its kernel only")
        if self.kernel == "mslk":
            return mslk_int4.dequantized(self.packed, self.mslk_scales, self.mslk_zeros, dtype)
        if self.kernel == "gemlite":
            return gemlite_weights.dequantized_int4(self, dtype).t()
        return dequantize_int4(unpack_nibbles(self.packed), self.scales, self.zeros, dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group={self.group}, {self.kernel}")


class Int8WeightOnlyLinear(nn.Module):
    """A Linear whose weight is int8 with one scale per output row (see module doc)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scales = quantize_int8(linear.weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales)
        self.bias = linear.bias

    gemlite_meta = None  # set by gemlite_weights.attach on a GPU with gemlite

    def gemlite_weight(self) -> torch.Tensor:
        return self.qweight.t()  # [K, N]: gemlite reads the app's layout through a view

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if gemlite_weights.takes(self, x2):
            y = gemlite_weights.product(self, x2).reshape(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        if x.dtype == torch.float16:
            # x @ q (|q| up to 127) can pass fp16's largest value before the scale brings it
            # back: scale the weight first (one more pass over it when not compiled).
            return F.linear(x, self.dequantized(x.dtype), self.bias)
        y = F.linear(x, self.qweight.to(x.dtype)) * self.scales.to(x.dtype)
        return y if self.bias is None else y + self.bias

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return self.qweight.to(dtype) * self.scales.to(dtype).unsqueeze(-1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


WEIGHT_ONLY_LAYERS = (Int4WeightOnlyLinear, Int8WeightOnlyLinear, Fp8Linear)


# -- a whole model -------------------------------------------------------------------------------
def quantizable(name: str, linear: nn.Linear, bits: int, group: int | None,
                fmt: str = "int") -> bool:
    """Every decoder Linear; lm_head stays full precision. int4 needs whole groups per row and
    tinygemm's tile multiples, fp8 _scaled_mm's multiples of 16; a layer of another shape keeps
    its weight (counted as such)."""
    if name.split(".")[-1] == "lm_head":
        return False
    if fmt == "fp8":
        return fp8_weights.fits(linear)
    if bits == 4:
        return (linear.in_features % group == 0 and linear.in_features % TINYGEMM_K_MULTIPLE == 0
                and linear.out_features % TINYGEMM_N_MULTIPLE == 0)
    return True


def int4_kernel(device: torch.device, compute_dtype: torch.dtype) -> str:
    """The kernel int4 layers use on this device (INT4_KERNELS): the first that runs here."""
    if device.type != "cuda" or compute_dtype != torch.bfloat16:
        return "dequantize"
    for kernel, unavailable in (("mslk", mslk_int4.unavailable_reason),
                                ("gemlite", gemlite_weights.unavailable_reason)):
        if unavailable(device, compute_dtype) is None:
            return kernel
    return "tinygemm"


def quantize_model(model: nn.Module, bits: int, group: int | None, device: torch.device,
                   progress=None, fmt: str = "int", kernel4: str | None = None) -> dict:
    """Replace the model's Linear layers by weight-only ones (`fmt` "int": int4 / int8 by
    `bits`; "fp8": fp8_weights.Fp8Linear) on `device`, one layer at a time, then move the rest
    there; int4 layers use `kernel4` (default: int4_kernel's).
    Returns {quantized, kept, seconds, parts: seconds by part of the work}."""
    start = time.perf_counter()
    if device.type == "cuda":
        # What the engine does to a bf16 model it compiles, done before quantizing (rows are
        # quantized one by one, so a fused layer has the separate layers' numbers).
        fuse_for_decoding(model)
    compute = model.get_input_embeddings().weight.dtype
    kernels4 = {}  # int4: the kernel of each weight shape, kernel4 until one fails for it
    kernel4 = kernel4 or int4_kernel(device, compute)
    label = "fp8" if fmt == "fp8" else f"int{bits}"
    # gemlite's kernels for the decode rows of 8-bit layers (gemlite_weights): None when they run.
    gemlite = gemlite_weights.unavailable_reason(device, compute) if bits == 8 else "4-bit"
    # Names only: a list of the modules would keep every bf16 weight alive to the end.
    targets = [name for name, module in model.named_modules() if type(module) is nn.Linear]
    kept, attached = [], 0
    parts = Counter()  # seconds by part of the work, for the log: where a slow load goes
    with torch.no_grad():
        for i, name in enumerate(targets):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            linear = getattr(parent, child)
            if not quantizable(name, linear, bits, group, fmt):
                kept.append(name)
                continue
            with _timed(parts, "moving", device):
                linear.to(device)  # this one layer in the compute dtype, on the device
            first = kernel4 in ("mslk", "gemlite") and bits == 4 and (
                linear.out_features, linear.in_features) not in kernels4
            part = "each shape's first layer, checked" if first else "rounding and packing"
            with _timed(parts, part, device):
                if fmt == "fp8":
                    layer = Fp8Linear(linear)
                elif bits == 4:
                    layer = _int4_layer(linear, group, kernels4, kernel4)
                else:
                    layer = Int8WeightOnlyLinear(linear)
            if gemlite is None and isinstance(layer, (Fp8Linear, Int8WeightOnlyLinear)):
                attached += gemlite_weights.attach(layer)
            setattr(parent, child, layer)
            del linear  # the parent held the only other reference: its weight is freed
            if progress and i % 32 == 0:
                progress(0.3 + 0.3 * i / len(targets),
                         f"quantizing to {label}: layer {i + 1} of {len(targets)}")
        with _timed(parts, "moving", device):
            model.to(device)
    if attached:  # every row bucket launched once now, not first inside a graph capture
        with _timed(parts, "kernel checks", device):
            for module in model.modules():
                if getattr(module, "gemlite_meta", None) is not None:
                    gemlite_weights.borrow_configs(module)  # once a shape
            gemlite_checks.check_kernels(model)
    if attached or "gemlite" in kernels4.values():
        if borrowed := gemlite_weights.borrowed_shapes(model):
            log.warning("gemlite has no tuned kernels on this GPU for the shapes %s: they run "
                        "with the nearest tuned shapes' configs (benchmarks/gemlite_search.py "
                        "--held-only tunes them, to ship in gemlite_configs/)",
                        ", ".join(borrowed))
        if untuned := gemlite_weights.untuned_shapes(model):
            log.warning("gemlite has no tuned kernels on this GPU for the shapes %s: it tunes "
                        "each at its first use (tens of seconds each, once; kept for later "
                        "loads)", ", ".join(untuned))
            if progress:
                progress(0.6, f"gemlite tunes its kernels for {len(untuned)} new weight shapes "
                              "at their first use (once on this GPU)")
        attached = sum(getattr(m, "gemlite_meta", None) is not None for m in model.modules())
    kernel = "converted to bf16"
    below = gemlite_weights.GEMLITE_BELOW_ROWS
    if fmt == "fp8":
        kernel = f"fp8 weight-only below {below} rows, scaled_mm above"
    if bits == 4:
        kinds = Counter(m.kernel for m in model.modules() if isinstance(m, Int4WeightOnlyLinear))
        kernel = ", ".join(f"{name} in {count} layers" for name, count in kinds.items())
    elif attached:
        kernel = (f"gemlite below {below} rows in {attached} layers, "
                  f"{'fp8 scaled_mm' if fmt == 'fp8' else kernel} above")
    model.weight_only = {"bits": bits, "group": group, "format": fmt, "kernel": kernel}
    seconds = time.perf_counter() - start
    log.info("quantized %d Linear layers to %s (%s) in %.1f s (%s); kept %s",
             len(targets) - len(kept), label, model.weight_only["kernel"], seconds,
             ", ".join(f"{part} {t:.1f} s" for part, t in parts.items()), kept or "none")
    return {"quantized": len(targets) - len(kept), "kept": kept, "seconds": seconds,
            "parts": {part: round(t, 2) for part, t in parts.items()}}


@contextlib.contextmanager
def _timed(parts: Counter, part: str, device: torch.device):
    """Add the seconds the block takes to parts[part], the GPU's queued work included (one
    synchronization a layer: the load waits for that work at its end anyway)."""
    start = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    parts[part] += time.perf_counter() - start


def _int4_layer(linear: nn.Linear, group: int, kernels: dict, kernel: str) -> nn.Module:
    """The int4 layer of `linear`, through the kernel `kernels` holds for its shape. A shape's
    first layer sets it: `kernel`, checked (its products held to the same numbers unpacked, at
    the row counts it will serve), or, where that kernel cannot pack the shape, fails or
    computes other numbers, the next that runs here (mslk, gemlite, then tinygemm, or off a
    GPU the dequantizing path; in the log and the kernel line), from the bf16 weight at hand."""
    shape = (linear.out_features, linear.in_features)
    if shape in kernels:
        return Int4WeightOnlyLinear(linear, group, kernel=kernels[shape])
    # The reference: the weight at some output features, rounded a row at a time (some of its
    # rows round as the whole matrix's do), apart from the packed layout the kernel reads.
    def weight_rows(rows):
        return dequantize_int4(*quantize_int4(linear.weight[rows], group), torch.float32)

    while kernel in ("mslk", "gemlite"):
        try:
            layer = Int4WeightOnlyLinear(linear, group, kernel=kernel)
            if kernel == "mslk":
                mslk_int4.check(layer, weight_rows)
            else:
                gemlite_weights.borrow_configs(layer)  # a shape this GPU has none for
                gemlite_checks.check_kernels(layer, weight_rows=weight_rows)
            kernels[shape] = kernel
            return layer
        except (torch.OutOfMemoryError, torch.AcceleratorError):
            raise  # the device's state, not the kernel's reach: no other would do better
        except Exception as error:  # noqa: BLE001 - the kernel's packing or product, this shape
            layer = None  # its packed copy (and, past the handler, the traceback's) goes first
            following = _next_int4_kernel(kernel, linear.weight.device)
            log.warning("%s's int4 kernels do not serve %dx%d weights here (%s: %s); %s does",
                        kernel, *shape, type(error).__name__, error, following)
            kernel = following
    layer = Int4WeightOnlyLinear(linear, group, kernel=kernel)
    kernels[shape] = kernel
    return layer


def _next_int4_kernel(failed: str, device: torch.device) -> str:
    if device.type != "cuda":
        return "dequantize"
    gemlite_runs = gemlite_weights.unavailable_reason(device, torch.bfloat16) is None
    return "gemlite" if failed == "mslk" and gemlite_runs else "tinygemm"


def load_quantized(path, bits: int, group: int | None, *, device_map: dict, dtype: torch.dtype,
                   progress=None, fmt: str = "int", **from_pretrained_kwargs) -> nn.Module:
    """from_pretrained into CPU memory in `dtype`, then quantize_model (`fmt`) onto the one
    device of `device_map` ({"": "cpu"} or {"": gpu index})."""
    from transformers import AutoModelForCausalLM

    if not isinstance(device_map, dict) or set(device_map) != {""}:
        name = "fp8" if fmt == "fp8" else f"int{bits} weight-only"
        raise ValueError(f"{name} runs on one device: pick the CPU or one GPU "
                         "(splitting and offloading are for the other modes)")
    target = device_map[""]
    device = torch.device(f"cuda:{target}" if isinstance(target, int) else target)
    check_staging_memory(path)
    model = AutoModelForCausalLM.from_pretrained(path, device_map={"": "cpu"}, dtype=dtype,
                                                 **from_pretrained_kwargs)
    quantize_model(model, bits, group, device, progress, fmt)
    # accelerate's map still says "cpu"; the weights now live on `device`.
    if getattr(model, "hf_device_map", None) is not None:
        model.hf_device_map = {"": str(device)}
    return model


def check_staging_memory(path) -> None:
    """The checkpoint passes through CPU memory on its way to being quantized: refuse (with the
    numbers) a load whose weights are larger than the memory available, rather than let the
    operating system end the process half-way."""
    from pathlib import Path

    import psutil

    from model_utils.memory import GB

    files = list(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
    needed = sum(f.stat().st_size for f in files)
    available = psutil.virtual_memory().available
    if needed > available:
        raise ValueError(f"weight-only modes quantize the checkpoint on its way from CPU memory: "
                         f"its {needed / GB:.1f} GB of weights exceed the {available / GB:.1f} "
                         "GB of memory available")


def inductor_options(model: nn.Module) -> dict:
    """Inductor settings for compiling a model with weight-only layers, {} for any other.

    Coordinate-descent tuning is what makes inductor decompose a one-row matmul into a fused
    reduction (torch/_inductor/decomposition.py, mm), so int8's dequantization is fused into
    the product; it also tunes that reduction's block sizes, which matrix-vector products need
    to reach the memory bandwidth (gpt-fast sets the same). A model may carry its own
    (`model.inductor_options`: the benchmark's candidates from other libraries do)."""
    own = getattr(model, "inductor_options", None)
    if own is not None:
        return dict(own)
    if not any(isinstance(m, WEIGHT_ONLY_LAYERS) for m in model.modules()):
        return {}
    return {"coordinate_descent_tuning": True}
