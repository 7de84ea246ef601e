"""Every projection fusion the decode path applies, in one call (see linear_fusion.py).

Applied to a model the engine compiles (runtime/preparation.py) and, before quantizing, to a
model it quantizes weight-only (weight_only.py: the fused matrix is quantized row by row, so it
has the separate layers' numbers). A layer that is not a plain nn.Linear of a known module is
left as it is.
"""

from __future__ import annotations

from torch import nn

from .fused_mlp import fuse_gate_up
from .fused_qkv import fuse_qkv
from .gated_delta import fuse_gated_delta

FUSIONS = (("q/k/v", fuse_qkv), ("gate/up", fuse_gate_up),
           ("linear-attention input", fuse_gated_delta))


def fuse_for_decoding(model: nn.Module) -> list[str]:
    """Fuse what applies; returns what was fused, e.g. ["one q/k/v matmul in 28 layers"]."""
    done = []
    for what, fuse in FUSIONS:
        count = fuse(model)
        if count:
            done.append(f"one {what} matmul in {count} layers")
    return done
