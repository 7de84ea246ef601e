"""Precision modes: one table from a mode name to what loading in that mode means.

A dispatch table rather than an if-chain: the loader, the fit estimate, the UI dropdown and the
benchmark all read the same frozen rows, so adding a mode is adding one line here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

Quantization = Literal["int8", "nf4", "fp4"] | None
# Dtypes by name, turned into torch dtypes only when used: reading the table (app.py --help
# lists the modes) must not cost the seconds that importing torch takes.
COMPUTE_DTYPES: dict[str, str] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a COMPUTE_DTYPES name: "bf16" -> torch.bfloat16."""
    import torch

    return getattr(torch, COMPUTE_DTYPES[name])


# Sections of the mode dropdown, in order.
FULL, FAST, SAVERS = "Full precision", "Fast quantized", "bitsandbytes memory savers"
GROUPS = (FULL, FAST, SAVERS)


@dataclass(frozen=True)
class Mode:
    name: str
    label: str
    # A COMPUTE_DTYPES name: dtype of the weights that stay unquantized (norms, embeddings,
    # lm_head); .dtype is the torch dtype.
    weight_dtype: str
    quantization: Quantization = None
    double_quant: bool = False
    # Bytes a parameter costs in memory. 4-bit packs two weights a byte and adds one absmax
    # scale per 64-weight block (fp32, or 8-bit plus a second-level scale with double quant).
    bytes_per_param: float = 2.0
    bytes_per_row: float = 0.0  # and per output row of a quantized Linear (a row scale)
    # Devices it runs on. bitsandbytes 0.49+ has CPU kernels for int8, nf4 and fp4, so every
    # mode runs on a CPU (slowly); the tuple is still per mode so a GPU-only one can be added.
    runs_on: tuple[str, ...] = ("cpu", "cuda")
    group: str = FULL  # its section of the dropdown
    # The app's own weight-only quantization (weight_only.py): 8 or 4 bits, None for the others;
    # int4 has one scale and one zero point per group_size weights of a row.
    weight_only_bits: int | None = None
    group_size: int | None = None
    # How those bits are read: "int" (weight_only.py) or "fp8" (e4m3, fp8_weights.py).
    weight_format: str = "int"
    # Whether the compiled CUDA-graph path applies on a GPU (bitsandbytes' int8 matmul breaks
    # graph capture, measured on an H200: BENCHMARKS.md).
    compiles: bool = True
    # How it compares with bf16 on a GPU and what to pick instead, where the comparison was
    # measured (BENCHMARKS.md, modes; the README's mode table has the figures).
    speed_note: str = ""

    @property
    def is_quantized(self) -> bool:
        return self.quantization is not None or self.weight_only_bits is not None

    @property
    def uses_bitsandbytes(self) -> bool:
        return self.quantization is not None

    @property
    def is_weight_only(self) -> bool:
        return self.weight_only_bits is not None

    def help(self, device: str | None = None) -> str:
        """What the mode costs on this kind of device ("cpu", "cuda"; default: this machine's),
        for the dropdown: bytes per parameter (scales and zero points included) and the path."""
        device = device or default_device()
        cost = f"{self.bytes_per_param:.2f} B/param"
        if device == "cpu":  # every mode decodes eagerly there: dropdown_info says it once
            if self.weight_format == "fp8":  # torch runs _scaled_mm on the CPU too
                return cost + "; the same fp8 arithmetic as on a GPU"
            return cost + ("; weights dequantized in every forward" if self.is_weight_only
                           else "")
        note = f"; {self.speed_note}" if self.speed_note else ""
        if not self.compiles:
            return f"{cost}; slow on this GPU: eager path{note}"
        if self.weight_only_bits == 8 and _gemlite_runs():
            prompts = "fp8 matmul" if self.weight_format == "fp8" else "weights converted to bf16"
            return (f"{cost}; compiled CUDA-graph path, gemlite's 8-bit kernels for replies, "
                    f"{prompts} for prompts{note}")
        if self.weight_format == "fp8":
            return (f"{cost}; compiled CUDA-graph path, fp8 weight-only for replies, fp8 "
                    f"matmul for prompts{note}")
        if self.weight_only_bits == 4:
            kernel = (", MSLK's int4 kernels (a GEMV for a few replies)" if _mslk_runs()
                      else ", gemlite's int4 kernels" if _gemlite_runs()
                      else ", tinygemm int4 kernel")
        else:
            kernel = {8: ", dequantization fused into the matmul"}.get(self.weight_only_bits, "")
        return f"{cost}; compiled CUDA-graph path{kernel}{note}"

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.weight_dtype)


def _mslk_runs() -> bool:
    """MSLK's kernels serve int4-wo on this GPU (model_utils.layers.mslk_int4)."""
    import torch

    from model_utils.layers.mslk_int4 import unavailable_reason

    return unavailable_reason(torch.device("cuda"), torch.bfloat16) is None


def _gemlite_runs() -> bool:
    """gemlite's kernels serve the weight-only modes on this GPU (model_utils.layers.gemlite_weights)."""
    import torch

    from model_utils.layers.gemlite_weights import unavailable_reason

    return unavailable_reason(torch.device("cuda"), torch.bfloat16) is None


# bitsandbytes 4-bit on the compiled path: one reply as fast as bf16, many at once about half.
SAVER_NOTE = "bf16's speed for one reply, half of it for many at once"

MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("fp32", "fp32", "fp32", bytes_per_param=4.0),
        Mode("bf16", "bf16", "bf16", bytes_per_param=2.0),
        Mode("fp16", "fp16", "fp16", bytes_per_param=2.0),
        # + one bf16 scale and one bf16 zero point per 128 weights
        Mode("int4-wo", "int4 weight-only, group 128", "bf16", group=FAST,
             weight_only_bits=4, group_size=128, bytes_per_param=0.5 + 4 / 128,
             speed_note="with MSLK (Hopper) faster than bf16 for one reply and a little for "
                        "many; with gemlite faster for one reply, slower for many at once "
                        "and for the first token; without either, fastest for one reply, "
                        "slow for many"),
        # + one bf16 scale per output row (rows of 3584-18944 weights in a 7B model)
        Mode("int8-wo", "int8 weight-only, per-row scales", "bf16", group=FAST,
             weight_only_bits=8, bytes_per_param=1.0, bytes_per_row=2.0,
             speed_note="with gemlite faster than bf16 for one reply and as fast for many, "
                        "a slower first token; without it, slow for many at once"),
        # + one fp32 scale per output row; a prompt's inputs (64 rows and more) are scaled to
        # e4m3 per token, a reply's stay bf16 (weight-only)
        Mode("fp8", "fp8 (e4m3) weights, per-row scales", "bf16", group=FAST,
             weight_only_bits=8, weight_format="fp8", bytes_per_param=1.0, bytes_per_row=4.0,
             speed_note="with gemlite faster than bf16 for one reply, a little slower for "
                        "many; the least exact 8-bit mode"),
        Mode("int8", "int8 LLM.int8", "fp16", "int8",
             bytes_per_param=1.0 + 4 / 4096, group=SAVERS, compiles=False,
             speed_note="bf16 for speed, nf4 for memory"),
        Mode("nf4", "nf4 4-bit", "bf16", "nf4",
             bytes_per_param=0.5 + 4 / 64, group=SAVERS, speed_note=SAVER_NOTE),
        Mode("nf4-dq", "nf4 4-bit + double quant", "bf16", "nf4", double_quant=True,
             bytes_per_param=0.5 + 1 / 64 + 4 / (64 * 256), group=SAVERS,
             speed_note=SAVER_NOTE),
        Mode("fp4", "fp4 4-bit", "bf16", "fp4",
             bytes_per_param=0.5 + 4 / 64, group=SAVERS, speed_note=SAVER_NOTE),
        Mode("fp4-dq", "fp4 4-bit + double quant", "bf16", "fp4", double_quant=True,
             bytes_per_param=0.5 + 1 / 64 + 4 / (64 * 256), group=SAVERS,
             speed_note=SAVER_NOTE),
    )
}


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def dropdown_choices(device: str | None = None) -> list[tuple[str, str]]:
    """(label, name) for the mode dropdown, section by section; each label carries its section
    and its cost on this device (a dropdown has no sections or per-entry help of its own). The
    labels say each thing once, the mode first, so that the closed box shows what is chosen."""
    return [(f"{_named(m)} · {m.help(device)} · {group}", m.name)
            for group in GROUPS for m in MODES.values() if m.group == group]


def _named(mode: Mode) -> str:
    """The label, led by the mode's name (--mode's, the docs') where the label does not."""
    if mode.label == mode.name or mode.label.startswith(mode.name + " "):
        return mode.label
    return f"{mode.name} · {mode.label}"


def dropdown_info(device: str | None = None) -> str:
    if (device or default_device()) == "cuda":
        return (f"{' / '.join(GROUPS)}. Each entry: bytes per parameter with its scales and "
                "zero points, and how it decodes on this GPU.")
    return (f"{' / '.join(GROUPS)}. Each entry: bytes per parameter with its scales and zero "
            "points. On the CPU every mode decodes eagerly (slow).")


def get_mode(name: str) -> Mode:
    try:
        return MODES[name]
    except KeyError:
        raise ValueError(f"unknown mode {name!r}; choose one of: {', '.join(MODES)}") from None


def unavailable_reason(mode: Mode, *, device: str) -> str | None:
    """Why this mode cannot run on this kind of device ("cpu" or "cuda"), or None."""
    if device not in mode.runs_on:
        return f"{mode.name} does not run on {device} (runs on: {', '.join(mode.runs_on)})"
    if mode.weight_format == "fp8":
        from model_utils.layers.fp8_weights import unavailable_reason as fp8_unavailable

        return fp8_unavailable(device)
    if mode.uses_bitsandbytes:
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            return f"{mode.name} needs the bitsandbytes package (pip install bitsandbytes)"
    return None


# bitsandbytes' CPU kernel for 4-bit weights packs them in rows of 32 output features (on CPUs
# with AVX512-BF16; it asserts "N must be divisible by block_n" otherwise).
BNB_CPU_ROWS = 32


def unpackable_linears(config) -> list[str]:
    """Names of the Linear layers bitsandbytes' CPU kernel cannot pack (out_features not a
    multiple of BNB_CPU_ROWS, or an odd in_features): Qwen3.5's per-head gates in_proj_a /
    in_proj_b have one output per value head. Kept unquantized, they are a few KB."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head")
                   and (module.out_features % BNB_CPU_ROWS or module.in_features % 2)})


def quantization_config(mode: Mode, *, compute_dtype: str = "bf16", cpu_offload: bool = False,
                        skip: list[str] | None = None):
    """The BitsAndBytesConfig for a quantized mode, None for a plain dtype mode. `skip`:
    module names to keep unquantized besides lm_head (unpackable_linears)."""
    if mode.quantization is None:
        return None
    from transformers import BitsAndBytesConfig

    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"unknown compute dtype {compute_dtype!r}; choose one of: "
                         f"{', '.join(COMPUTE_DTYPES)}")
    skipped = {"llm_int8_skip_modules": ["lm_head", *skip]} if skip else {}
    if mode.quantization == "int8":
        # Modules that spill to the CPU stay fp32 there; bitsandbytes insists on this flag.
        return BitsAndBytesConfig(load_in_8bit=True,
                                  llm_int8_enable_fp32_cpu_offload=cpu_offload, **skipped)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=mode.quantization,
        bnb_4bit_use_double_quant=mode.double_quant,
        bnb_4bit_compute_dtype=torch_dtype(compute_dtype),
        llm_int8_enable_fp32_cpu_offload=cpu_offload,
        **skipped,
    )
