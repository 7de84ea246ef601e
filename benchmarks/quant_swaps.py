"""The benchmark's candidates from other libraries, and variants of the app's own modes: each
swaps layers into a model the engine has just loaded, before it compiles (quant_candidates.py).
"""

from __future__ import annotations

import types

import torch

from model_utils.loading.modes import MODES

CUDA = torch.cuda.is_available()


def _linears(model, kind: type = torch.nn.Linear):
    """(parent, child name, layer) of every layer of exactly this class but lm_head."""
    for name, module in list(model.named_modules()):
        if type(module) is kind and not name.endswith("lm_head"):
            parent, _, child = name.rpartition(".")
            yield model.get_submodule(parent), child, module


def torchao_int4(model):
    from torchao.quantization import Int4WeightOnlyConfig, quantize_

    quantize_(model, Int4WeightOnlyConfig(group_size=128,
                                          int4_packing_format="tile_packed_to_4d"),
              filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and "lm_head" not in fqn)


def torchao_int8(model):
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    quantize_(model, Int8WeightOnlyConfig(),
              filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and "lm_head" not in fqn)


def _gemlite_configs() -> None:
    """The tuned kernel configs the app's own 8-bit layers load (gemlite_weights: the H200's
    shipped, gemlite's for the GPUs it names, what earlier loads tuned)."""
    from model_utils.layers import gemlite_weights

    if reason := gemlite_weights.unavailable_reason(torch.device("cuda"), torch.bfloat16):
        raise RuntimeError(reason)


def save_gemlite_configs(path) -> None:
    """The kernel configs gemlite tuned in this process, merged into `path` (JSON): the file
    to ship for a GPU it has none for (gemlite.core.GemLiteLinear.load_config reads it)."""
    import gemlite.core as core

    core.GemLiteLinear.cache_config(str(path))


def gemlite_int8(model):
    from gemlite.helper import A16W8_INT8

    _gemlite_configs()

    device = model.get_input_embeddings().weight.device
    for parent, child, linear in _linears(model):
        setattr(parent, child, A16W8_INT8(device=device, dtype=torch.bfloat16).from_linear(linear))
        del linear
    torch.cuda.empty_cache()


def aten_int8(model, *, rows_from: int = 1):
    """The app's int8-wo numbers through PyTorch's own int8 weight-only kernel
    (torch._weight_int8pack_mm, CUDA and CPU) for inputs of at least `rows_from` rows, instead
    of the dequantize-and-multiply (which the one-row step compiles into one reduction)."""
    from model_utils.layers.weight_only import Int8WeightOnlyLinear

    def forward(self, x):
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] < rows_from:  # a static shape: decided once, when compiled or captured
            return Int8WeightOnlyLinear.forward(self, x)
        y = torch._weight_int8pack_mm(x2.contiguous(), self.qweight, self.scales.to(x.dtype))
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    for module in model.modules():
        if isinstance(module, Int8WeightOnlyLinear):
            module.forward = types.MethodType(forward, module)


def app_int4(group: int = 128, kernel: str | None = None):
    """The app's int4-wo layers (each group's range searched) in groups of `group` weights
    (the mode's: 128; finer costs speed and gives KL), through `kernel` (the mode's:
    weight_only.int4_kernel's, gemlite where installed, else tinygemm)."""

    def swap(model):
        from model_utils.layers.weight_only import inductor_options, quantize_model

        device = model.get_input_embeddings().weight.device
        quantize_model(model, 4, group, device, kernel4=kernel)
        model.inductor_options = inductor_options(model)  # the app's, kept by measure()

    return swap


def int8_head(model):
    """lm_head in int8 weight-only too (the app's modes keep it in bf16): on the 7B shape it is
    1.09 GB of the ~4.5 GB an int4 token reads."""
    from model_utils.layers.weight_only import Int8WeightOnlyLinear

    head = model.get_output_embeddings()
    if type(head) is torch.nn.Linear and head.weight is not model.get_input_embeddings().weight:
        model.set_output_embeddings(Int8WeightOnlyLinear(head))
        del head
        if CUDA:
            torch.cuda.empty_cache()


def gemlite_fp8(model, *, dynamic: bool = False):
    """gemlite's kernels on the app's fp8 numbers (e4m3 weights, one scale per row): A16W8_FP8
    multiplies bf16 inputs by the fp8 weights (weight-only), A8W8_fp8_dynamic scales the
    inputs to fp8 per token as the app's _scaled_mm path does."""
    from gemlite.helper import A16W8_FP8, A8W8_fp8_dynamic

    from model_utils.layers.fp8_weights import Fp8Linear

    _gemlite_configs()

    device = model.get_input_embeddings().weight.device
    for parent, child, layer in _linears(model, Fp8Linear):
        if dynamic:  # quantizes again from the dequantized weights: the same rows and scales
            linear = torch.nn.Linear(layer.in_features, layer.out_features, bias=False,
                                     device=device, dtype=torch.bfloat16)
            linear.weight.data = layer.dequantized(torch.bfloat16)
            linear.bias = layer.bias
            swapped = A8W8_fp8_dynamic(device=device, dtype=torch.bfloat16).from_linear(linear)
        else:
            swapped = A16W8_FP8(device=device, dtype=torch.bfloat16).from_weights(
                layer.qweight, bias=layer.bias, scales=layer.scales.unsqueeze(1))
        setattr(parent, child, swapped)
        del layer
    torch.cuda.empty_cache()


def gemlite_fp8_head(model):
    """gemlite's fp8 weight-only kernels on the decoder layers and on lm_head too (the app's
    modes keep lm_head in bf16: 1.09 GB of the ~8.7 GB an fp8 token of the 7B shape reads)."""
    from gemlite.helper import A16W8_FP8

    from model_utils.layers.fp8_weights import quantize_fp8

    gemlite_fp8(model)
    head = model.get_output_embeddings()
    if type(head) is torch.nn.Linear and head.weight is not model.get_input_embeddings().weight:
        q, scales = quantize_fp8(head.weight)
        model.set_output_embeddings(A16W8_FP8(device=head.weight.device, dtype=torch.bfloat16)
                                    .from_weights(q, bias=head.bias, scales=scales.unsqueeze(1)))
        del head, q
        torch.cuda.empty_cache()


def int8_head_gemlite(model):
    """lm_head in the app's int8 weight-only, through gemlite's kernels for decode rows as the
    app's int8-wo layers are: with the int8-wo mode, every weight a token reads in 8 bits."""
    from model_utils.layers import gemlite_checks, gemlite_weights
    from model_utils.layers.weight_only import Int8WeightOnlyLinear

    int8_head(model)
    head = model.get_output_embeddings()
    if isinstance(head, Int8WeightOnlyLinear):
        _gemlite_configs()
        if gemlite_weights.attach(head):
            gemlite_checks.check_kernels(model)


def gemlite_for_prompts_too(model):
    """The app's 8-bit layers with gemlite's kernels at every row count (its GEMM from 64 rows)
    instead of the layer's own path for prompts: int8-wo's converts each weight to bf16 before
    cuBLAS, fp8's scales the inputs to e4m3 for _scaled_mm."""
    from model_utils.layers.fp8_weights import Fp8Linear
    from model_utils.layers.weight_only import Int8WeightOnlyLinear

    for module in model.modules():
        if isinstance(module, (Int8WeightOnlyLinear, Fp8Linear)):
            if module.gemlite_meta is None:
                raise RuntimeError("the app's 8-bit layers run without gemlite here")
            module.gemlite_below_rows = 1 << 30


def fp8_weight_only_below(rows: int):
    """The app's fp8 mode with inputs of fewer than `rows` rows multiplied unquantized (the
    weight-only product, compiled into a reduction over the fp8 weights) instead of through
    _scaled_mm: which is faster for decode steps is what this candidate measures."""
    from model_utils.layers.fp8_weights import Fp8Linear

    def swap(model):
        for module in model.modules():
            if isinstance(module, Fp8Linear):
                module.scaled_mm_from_rows = rows
                module.gemlite_meta = None  # inductor's product, not gemlite's
    return swap


def int4_dequantized_for_prompts(rows: int):
    """The app's int4-wo with inputs of `rows` rows or more (prompts) multiplied by each weight
    dequantized to bf16 (one compiled kernel a layer, into a buffer of one layer's size) and
    cuBLAS, instead of gemlite's GEMM: which is faster for prompts is what this measures."""
    from model_utils.layers.weight_only import Int4WeightOnlyLinear

    def swap(model):
        for module in model.modules():
            if isinstance(module, Int4WeightOnlyLinear):
                if module.kernel != "gemlite":
                    raise RuntimeError(f"the app's int4 layers run {module.kernel} here")
                module.dequant_from_rows = rows
    return swap


def int8_fragment_order(model):
    """The app's int8-wo with its copy kept in the tensor cores' fragment order
    (model_utils/layers/int8_rows.py), every row count through int8_rows' kernel over it (a
    reply step's rows in one block, K in shares; a prompt's in blocks of 64): one copy, as the
    mode keeps one."""
    from model_utils.layers import int8_rows, mslk_gemv
    from model_utils.layers.weight_only import Int8WeightOnlyLinear

    def forward(self, x):
        x2 = x.reshape(-1, self.in_features)
        y = int8_rows.layer_product(x2, self.qweight, self.scales, self.rows_sums,
                                    self.rows_counts).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantized(self, dtype):  # what the checks read: the copy put back in order
        return int8_rows.unpack(self.qweight).to(dtype) * self.scales.to(dtype).unsqueeze(-1)

    for module in model.modules():
        if isinstance(module, Int8WeightOnlyLinear):
            module.qweight = int8_rows.pack(module.qweight)
            sums, counts = mslk_gemv.workspace(int8_rows.MOST_ROWS, module.out_features,
                                               module.qweight.device)
            module.register_buffer("rows_sums", sums, persistent=False)
            module.register_buffer("rows_counts", counts, persistent=False)
            module.gemlite_meta = None
            module.forward = types.MethodType(forward, module)
            module.dequantized = types.MethodType(dequantized, module)


# What torchao's README advises for its weight-only layers under torch.compile (gpt-fast's
# settings); given to the torchao and gemlite candidates' compiled step.
LIBRARY_INDUCTOR_OPTIONS = {"coordinate_descent_tuning": True,
                            "coordinate_descent_check_all_directions": True,
                            "force_fuse_int_mm_with_mul": True, "use_mixed_mm": True}

# name: (swap, package it needs, CUDA only, the app's mode it starts from)
SWAPS = {"torchao-int4": (torchao_int4, "torchao", True, "bf16"),
         "torchao-int8": (torchao_int8, "torchao", False, "bf16"),
         "gemlite-int8": (gemlite_int8, "gemlite", True, "bf16"),
         "int8-wo-aten": (aten_int8, "torch", False, "int8-wo"),
         "int8-wo-hybrid": (lambda m: aten_int8(m, rows_from=2), "torch", False, "int8-wo"),
         "int4-wo-head8": (int8_head_gemlite, "gemlite", True, "int4-wo"),
         "int4-wo-g64": (app_int4(64), "torch", False, "bf16"),
         "int4-wo-tinygemm": (app_int4(kernel="tinygemm"), "torch", True, "bf16"),
         "int4-wo-gemlite": (app_int4(kernel="gemlite"), "gemlite", True, "bf16"),
         "int4-wo-mslk": (app_int4(kernel="mslk"), "mslk", True, "bf16"),
         "int4-wo-dequant-prompts": (int4_dequantized_for_prompts(256), "gemlite", True,
                                     "int4-wo"),
         "int8-wo-head8": (int8_head_gemlite, "gemlite", True, "int8-wo"),
         "int8-wo-gemlite-prompts": (gemlite_for_prompts_too, "gemlite", True, "int8-wo"),
         "int8-wo-rows": (int8_fragment_order, "triton", True, "int8-wo"),
         "fp8-wo-below-8": (fp8_weight_only_below(8), "torch", False, "fp8"),
         "gemlite-fp8": (gemlite_fp8, "gemlite", True, "fp8"),
         "gemlite-fp8-head": (gemlite_fp8_head, "gemlite", True, "fp8"),
         "gemlite-fp8-dynamic": (lambda m: gemlite_fp8(m, dynamic=True), "gemlite", True, "fp8")}


def missing(candidate: str) -> str | None:
    if candidate in MODES:
        return None
    if candidate not in SWAPS:
        return f"unknown candidate (modes: {', '.join(MODES)}; swaps: {', '.join(SWAPS)})"
    _, package, cuda_only, _ = SWAPS[candidate]
    if cuda_only and not CUDA:
        return "needs a CUDA GPU"
    try:
        __import__(package)
    except Exception as error:  # noqa: BLE001 - a missing or broken package, reported
        return f"{package} not importable: {type(error).__name__}: {str(error)[:200]}"
    return None
