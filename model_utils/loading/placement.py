"""Where the weights go, and whether they fit there before anything is loaded.

Placements: the CPU; one GPU (cuda:N); accelerate's device_map strategies (auto, balanced,
balanced_low_0, sequential) with optional per-device caps; CPU offload (what does not fit under
the GPU caps stays in RAM) and disk offload (into an offload folder).

"auto" means "one GPU whenever the model fits there": splitting a model that fits on one GPU over
two made decoding 5x slower (8.4 vs 41.3 tok/s measured on 2x H200), because each token then
waits on both devices in turn and on the copy between them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import psutil

from model_utils.memory import GB

from .modes import Mode

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


@dataclass(frozen=True)
class Placement:
    target: str = "auto"  # "cpu" | "cuda:N" | one of STRATEGIES
    # Per-device caps in GB: {"cuda:0": 20, "cpu": 64}. Under a strategy they bound what
    # accelerate puts on each device; what is left goes to the CPU (and then to disk).
    max_memory_gb: dict[str, float] = field(default_factory=dict)
    offload_folder: str | None = None  # set: weights that fit nowhere go to disk

    def describe(self) -> str:
        text = self.target
        if self.max_memory_gb:
            caps = ", ".join(f"{k} <= {v:g} GB" for k, v in self.max_memory_gb.items())
            text += f" ({caps})"
        if self.offload_folder:
            text += f", disk offload to {self.offload_folder}"
        return text


def check_placement(placement: Placement) -> None:
    """Refuse (ValueError, a plain message) what no load could use: a target that is not a
    name, a cap for a device this machine lacks, a cap that is not a positive number. Checked
    before the current model is unloaded."""
    if not isinstance(placement, Placement):
        raise ValueError("placement must be a Placement")  # noqa: TRY004 - a refusal
    if not isinstance(placement.target, str):
        raise ValueError("the placement must be a name: cpu, cuda:N or one of "  # noqa: TRY004
                         f"{', '.join(STRATEGIES)}")
    if reason := unavailable_reason(placement.target):
        raise ValueError(reason)
    caps = placement.max_memory_gb
    if not isinstance(caps, dict):
        raise ValueError("max_memory must map device names to GB, "  # noqa: TRY004
                         "e.g. {\"cuda:0\": 20}")
    known = known_devices()
    for device, gb in caps.items():
        if not isinstance(device, str) or device not in known:
            shown = repr(device) if isinstance(device, str) and len(device) <= 40 else "a name"
            raise ValueError(f"max_memory names device {shown}, which this machine does not "
                             f"have (it has: {', '.join(known)})")
        if isinstance(gb, bool) or not isinstance(gb, (int, float)) or not 0 < gb < math.inf:
            raise ValueError(f"max_memory for {device} must be a positive number of GB, "
                             f"got {gb!r}"[:160])
    if placement.offload_folder is not None and not isinstance(placement.offload_folder, str):
        raise ValueError("the offload folder must be a path")


def gpu_count() -> int:
    # torch is imported here, not at the top: a front end for a model server (--backend)
    # reads Placement and builds no load, and starts without torch.
    import torch

    return torch.cuda.device_count()


def known_devices() -> list[str]:
    """The device names a max_memory cap may use here (accelerate also takes "disk")."""
    return ["cpu", *(f"cuda:{i}" for i in range(gpu_count())), "disk"]


def available_placements() -> list[str]:
    gpus = [f"cuda:{i}" for i in range(gpu_count())]
    return ["cpu", *gpus, *STRATEGIES] if gpus else ["cpu"]


def unavailable_reason(target: str) -> str | None:
    if target == "cpu":
        return None
    if target in STRATEGIES:
        # Without a GPU accelerate still places by strategy over the CPU and, past the CPU
        # cap, an offload folder on disk: real offloading that runs (and is tested) anywhere.
        return None
    if not target.startswith("cuda:"):
        return f"unknown placement {target!r}; choose cpu, cuda:N or one of {', '.join(STRATEGIES)}"
    if not gpu_count():
        return f"placement {target!r} needs a CUDA GPU and this machine has none"
    index = target.removeprefix("cuda:")
    if not index.isdigit() or int(index) >= gpu_count():
        return f"no such GPU {target!r}: this machine has {gpu_count()}"
    return None


# -- the fit estimate ---------------------------------------------------------------------------
@dataclass(frozen=True)
class FitEstimate:
    weights_gb: float
    kv_cache_gb: float
    context_tokens: int
    free_gb: dict[str, float]  # device -> free GB now
    fits: bool
    plan: str  # one line: where it would go
    caps_gb: dict[str, float] = field(default_factory=dict)  # the Placement's per-device caps
    # Memory the model now loaded would give back (counted in free_gb): judged before unloading
    reclaimable_gb: dict[str, float] = field(default_factory=dict)

    @property
    def needed_gb(self) -> float:
        return self.weights_gb + self.kv_cache_gb

    def message(self) -> str:
        # A cap below what is free is what the fit was judged against: say so, or the message
        # reads "needs 0.01 GB; free 22 GB" for a refusal.
        free = ", ".join(
            f"{d} {size(g)}" + (f" (capped at {self.caps_gb[d]:g} GB)"
                                if self.caps_gb.get(d, float("inf")) < g else "")
            for d, g in self.free_gb.items())
        reclaimed = ", ".join(f"{d} {size(g)}" for d, g in self.reclaimable_gb.items() if g)
        if reclaimed:
            free += f" (counting {reclaimed} that unloading the current model frees)"
        # The least a load takes: the batch cache grows past one context where memory allows.
        return (f"needs at least {size(self.needed_gb)} (weights {size(self.weights_gb)} + KV "
                f"cache {size(self.kv_cache_gb)} for one {self.context_tokens}-token context; "
                f"more for several replies where memory allows); free: {free}; {self.plan}")


def size(gb: float) -> str:
    """GB with two decimals, or MB below 0.1 GB (the demo model would read "0.00 GB")."""
    return f"{gb:.2f} GB" if gb >= 0.1 else f"{gb * 1024:.1f} MB"


def free_memory_gb() -> dict[str, float]:
    free = {}
    import torch

    for i in range(gpu_count()):
        free_bytes, _total = torch.cuda.mem_get_info(i)
        free[f"cuda:{i}"] = free_bytes / GB
    free["cpu"] = psutil.virtual_memory().available / GB
    return free


def weight_bytes(config, mode: Mode) -> float:
    """Bytes the weights take in this mode, counted on a meta-device copy (nothing allocated).

    bitsandbytes quantizes the decoder's Linear layers only; embeddings, norms and lm_head keep
    the mode's dtype, which matters for small models whose vocabulary is a large share.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from model_utils.layers.weight_only import quantizable

    # torch's device context is per thread. accelerate's init_empty_weights patches
    # nn.Module for the whole process: an estimate (the page asks for one on every change)
    # running beside a load put that load's new tensors on the meta device too ("Tensor on
    # device meta" in the first reply after a switch).
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    dtype_bytes = torch.tensor([], dtype=mode.dtype).element_size()
    total = 0.0
    for name, module in model.named_modules():
        direct = sum(p.numel() for p in module.parameters(recurse=False))
        if not direct:
            continue
        quantized = (mode.is_quantized and isinstance(module, torch.nn.Linear)
                     and not name.endswith("lm_head"))
        if quantized and mode.is_weight_only:  # a shape int4's kernel cannot take stays as is
            quantized = quantizable(name, module, mode.weight_only_bits, mode.group_size,
                                    mode.weight_format)
        total += direct * (mode.bytes_per_param if quantized else dtype_bytes)
        total += module.out_features * mode.bytes_per_row if quantized else 0
    return total


def kv_cache_bytes(config, context_tokens: int, *, batch: int = 1, dtype_bytes: int = 2) -> float:
    """What `batch` replies of `context_tokens` keep: K and V per attention layer, per KV head,
    head_dim values each, for every token; and a linear-attention layer's fixed state (its
    convolution's last inputs, and the delta rule's [heads, key, value] state in float32)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    linear = types.count("linear_attention")
    attention = len(types) - linear
    total = 2 * attention * kv_heads * head_dim * context_tokens * dtype_bytes
    if linear:
        k_heads, v_heads = text.linear_num_key_heads, text.linear_num_value_heads
        k_dim, v_dim = text.linear_key_head_dim, text.linear_value_head_dim
        conv = (2 * k_heads * k_dim + v_heads * v_dim) * text.linear_conv_kernel_dim * dtype_bytes
        total += linear * (conv + v_heads * k_dim * v_dim * 4)
    return total * batch


def estimate_fit(config, mode: Mode, placement: Placement, *, context_tokens: int,
                 reclaimable_gb: dict[str, float] | None = None,
                 weights_gb: float | None = None) -> FitEstimate:
    """Whether the model fits where `placement` puts it. reclaimable_gb: per device, what is
    held now but would be freed first (the model a switch unloads), counted as free.
    weights_gb: the weights' size when known already (weight_bytes builds the model on the
    meta device to count it)."""
    weights = weight_bytes(config, mode) / GB if weights_gb is None else weights_gb
    kv = kv_cache_bytes(config, context_tokens,
                        dtype_bytes=4 if mode.weight_dtype == "fp32" else 2) / GB
    need = weights + kv
    reclaimable = {d: g for d, g in (reclaimable_gb or {}).items() if g > 0}
    free = {d: g + reclaimable.get(d, 0.0) for d, g in free_memory_gb().items()}
    caps = {d: min(free.get(d, 0.0), placement.max_memory_gb.get(d, float("inf")))
            for d in free}
    target = placement.target
    if target == "cpu" or target.startswith("cuda:"):
        fits = caps.get(target, 0.0) >= need
        plan = f"all on {target}"
    elif target == "auto" and (best := _best_single_gpu(caps, need)):
        fits, plan = True, f"auto: fits on one GPU, all on {best}"
    else:
        gpu_room = sum(v for d, v in caps.items() if d != "cpu")
        fits = placement.offload_folder is not None or gpu_room + caps["cpu"] >= need
        spill = []
        if gpu_room and need > gpu_room:
            spill.append("CPU")
        if placement.offload_folder and need > gpu_room + caps["cpu"]:
            spill.append("disk")
        plan = f"{target}: " + ("split over the GPUs" if gpu_room else "no GPU")
        if spill:
            plan += ", offloaded to the " + " and ".join(spill)
    return FitEstimate(weights, kv, context_tokens, free, fits, plan,
                       caps_gb=dict(placement.max_memory_gb),
                       reclaimable_gb={d: g for d, g in reclaimable.items() if d in free})


def _best_single_gpu(caps: dict[str, float], need: float) -> str | None:
    gpus = {d: v for d, v in caps.items() if d.startswith("cuda:") and v >= need}
    return max(gpus, key=gpus.get) if gpus else None


def device_map_kwargs(placement: Placement, estimate: FitEstimate) -> dict:
    """from_pretrained keyword arguments that realise this placement."""
    target = placement.target
    if target == "cpu":
        return {"device_map": {"": "cpu"}}
    if target.startswith("cuda:"):
        return {"device_map": {"": int(target.removeprefix("cuda:"))}}
    if target == "auto" and estimate.plan.startswith("auto: fits on one GPU"):
        return {"device_map": {"": int(estimate.plan.rsplit("cuda:", 1)[1])}}
    kwargs: dict = {"device_map": target}
    if placement.max_memory_gb:
        kwargs["max_memory"] = {
            (int(d.removeprefix("cuda:")) if d.startswith("cuda:") else d): f"{gb}GiB"
            for d, gb in placement.max_memory_gb.items()
        }
    if placement.offload_folder:
        kwargs["offload_folder"] = placement.offload_folder
    return kwargs


def may_offload_to_cpu(kwargs: dict) -> bool:
    """True when accelerate may leave modules on the CPU (bitsandbytes must then be told)."""
    return isinstance(kwargs["device_map"], str)
