"""One matmul for an MLP's gate and up projections.

A SwiGLU MLP multiplies the same input by two matrices of the same shape (gate and up), then
combines them: one [2 x intermediate, hidden] product instead of two launches half the
matmul kernels of a decode step's MLP (linear_fusion.py).

Applied only to MLP classes whose forward is transformers' `down(act(gate(x)) * up(x))`
(transformers 5.24, listed below); the tests compare the fused forward with the original.
"""

from __future__ import annotations

import logging
import types

import torch
from torch import nn

from .linear_fusion import fuse_linears, plain_linears

log = logging.getLogger(__name__)

FUSABLE = {"Qwen2MLP", "Qwen3MLP", "LlamaMLP", "Qwen3_5MLP", "Qwen3_5MoeMLP", "Qwen3NextMLP",
           "Qwen2MoeMLP", "Qwen3MoeMLP"}
PROJECTIONS = ("gate_proj", "up_proj")


def fuse_gate_up(model: nn.Module) -> int:
    """Fuse every fusable MLP of `model` in place; returns how many were fused."""
    fused = 0
    for module in model.modules():
        if type(module).__name__ in FUSABLE and plain_linears(module, PROJECTIONS):
            fuse_linears(module, PROJECTIONS, "gate_up_proj")
            module.forward = types.MethodType(fused_forward, module)
            fused += 1
    if fused:
        log.info("fused the gate/up projections of %d MLPs", fused)
    return fused


def fused_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)
