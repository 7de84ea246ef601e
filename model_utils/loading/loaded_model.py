"""What a load asks for (LoadRequest), what it gives (LoadedModel) and what an unload reports
(UnloadReport): the records the manager, the engine and the status share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .load_stages import Stage
from .modes import Mode
from .placement import FitEstimate, Placement
from .registry import ModelSource
from .tokenizer_reuse import TokenizerKey

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class LoadRequest:
    model: str = "demo"
    mode: str = "bf16"
    placement: Placement = field(default_factory=Placement)
    compute_dtype: str = "bf16"  # 4-bit modes only
    context_tokens: int | None = None  # default: the model's own, or what fits


@dataclass(frozen=True)
class SwitchCost:
    """What the load that brought a model in cost the user, beyond its own stages: the whole
    wait from the request (the checks, replies ending, the unload of the model it replaced,
    the load, getting ready), and what it took from the load before it instead of reading it
    again. Set on a model restored after a failed switch too, with the failure."""

    total_s: float
    replaced: str = ""  # "demo model (fp32)": the model unloaded first, "" when none was
    unload_s: float = 0.0
    tokenizer_kept: bool = False
    failed: str = ""  # on a model restored: what the failed switch was to ("x in bf16")
    weights_parked: bool = False  # taken back from host memory, not read (--park-gb)

    def as_dict(self) -> dict:
        caches = ["tokenizer"] * self.tokenizer_kept + ["parked weights"] * self.weights_parked
        return {"s": round(self.total_s, 3), "unload_s": round(self.unload_s, 3),
                **({"replaced": self.replaced} if self.replaced else {}),
                "from_caches": caches,
                **({"failed": self.failed} if self.failed else {})}


@dataclass
class LoadedModel:
    source: ModelSource
    request: LoadRequest
    mode: Mode
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    context_tokens: int
    load_s: float
    footprint_gb: float
    device_map: dict[str, dict]  # device -> {"layers": "0-13", "gb": 7.1}
    estimate: FitEstimate
    from_pretrained_kwargs: dict
    # memory_counters() just before this model was loaded: what an unload should come back to
    memory_before_load: dict[str, float] = field(default_factory=dict)
    # Each stage of getting ready (reading weights, quantizing, compiling, capturing) and the
    # whole of it, from the request to the first reply it can serve.
    stages: list[Stage] = field(default_factory=list)
    ready_s: float = 0.0
    # Why the context is shorter than the model's own (memory), "" when it is not
    context_note: str = ""
    # What a user should know of this load (the context made shorter, a vision tower skipped)
    notes: list[str] = field(default_factory=list)
    # What the tokenizer was read from, so that a switch within the model can keep it
    tokenizer_key: TokenizerKey | None = None
    tokenizer_kept: bool = False  # taken from the model this load replaced, not read again
    weights_parked: bool = False  # taken back from host memory (parked_models), not read
    switch: SwitchCost | None = None  # the whole wait of the load, set once it is ready

    @property
    def display_name(self) -> str:
        return self.source.label

    def status(self) -> dict:
        """What is loaded, as the status endpoint, the page and the log show it (the engine
        adds how it is served: runtime.serving.Serving.status)."""
        return {
            "loaded": True,
            "model": self.display_name,
            "path": str(self.source.path),
            "is_demo": self.source.is_demo,
            "mode": self.mode.name,
            "placement": self.request.placement.describe(),
            "device_map": self.device_map,
            "load_s": round(self.load_s, 3),
            "ready_s": round(self.ready_s, 3),  # as precise as load_s, which it includes
            "load_stages": [stage.as_dict() for stage in self.stages],
            **({"last_switch": self.switch.as_dict()} if self.switch else {}),
            "footprint_gb": round(self.footprint_gb, 4),
            "context_tokens": self.context_tokens,
            **({"context_note": self.context_note} if self.context_note else {}),
            **({"notes": list(self.notes)} if self.notes else {}),
            "estimate": self.estimate.message(),
            **({"adapter": self.source.adapter.name,
                "adapter_merged": not self.mode.is_quantized} if self.source.adapter else {}),
        }


@dataclass(frozen=True)
class UnloadReport:
    model: str
    before: dict[str, float]
    after: dict[str, float]
    # Per counter (GB), never negative: what is still held over the memory before the load
    # (only counters over LEFTOVER_FLOOR_GB), and what the unload gave back.
    leftover: dict[str, float]
    freed: dict[str, float] = field(default_factory=dict)
    # Where a CUDA leftover is known: the largest tensors still referenced (largest_live_tensors)
    held_by: list[str] = field(default_factory=list)
    # When the model object outlived the unload: what still refers to it (model_referrers)
    model_kept_by: list[str] = field(default_factory=list)
    parked_gb: float = 0.0  # kept in host memory for a switch back (--park-gb)

    def as_dict(self) -> dict:
        return {"model": self.model, "leftover": self.leftover, "freed": self.freed,
                **({"parked_gb": round(self.parked_gb, 3)} if self.parked_gb else {}),
                **({"held_by": self.held_by} if self.held_by else {}),
                **({"model_kept_by": self.model_kept_by} if self.model_kept_by else {})}


