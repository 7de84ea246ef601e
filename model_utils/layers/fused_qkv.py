"""One matmul for an attention layer's query, key and value projections.

Decoding one token, each projection is a matrix-vector product, and the key and value ones are
small (Qwen2.5-7B: 3584 x 512): too small to reach the GPU's memory bandwidth, each costs a
kernel of fixed latency plus cuBLAS's split-K reduction (6-9 us each on the H200,
benchmarks/HISTORY.md).
Concatenating the three weights into one [q + k + v, hidden] matrix makes them one product of the
size of the query's alone.

Applied only to attention classes whose forward is known (below), by giving those modules a
forward that is transformers' own with the three projections replaced by one and a split
(linear_fusion.py); the tests compare it with the original forward.
"""

from __future__ import annotations

import logging
import sys
import types
from typing import TYPE_CHECKING

import torch
from torch import nn

from .linear_fusion import fuse_linears, plain_linears

if TYPE_CHECKING:
    from transformers.cache_utils import Cache

log = logging.getLogger(__name__)

# Attention classes whose forward the fused forwards below reproduce (transformers 5.24):
# projections, an optional per-head q/k RMSNorm (Qwen3), rotary embedding, cache update, the
# attention interface; the gated ones (Qwen3.5, Qwen3-Next) also an output gate that their query
# projection computes beside the query.
PLAIN = {"Qwen2Attention", "Qwen3Attention", "LlamaAttention"}
GATED = {"Qwen3_5Attention", "Qwen3_5MoeAttention", "Qwen3NextAttention"}
PROJECTIONS = ("q_proj", "k_proj", "v_proj")


def fuse_qkv(model: nn.Module) -> int:
    """Fuse every fusable attention layer of `model` in place; returns how many were fused."""
    fused = 0
    for module in model.modules():
        kind = type(module).__name__
        if (kind in PLAIN or kind in GATED) and plain_linears(module, PROJECTIONS):
            _fuse(module, gated_forward if kind in GATED else fused_forward)
            fused += 1
    if fused:
        log.info("fused the q/k/v projections of %d attention layers", fused)
    return fused


def _fuse(module: nn.Module, forward) -> None:
    module.qkv_sizes = fuse_linears(module, PROJECTIONS, "qkv_proj")
    home = sys.modules[type(module).__module__]  # the model's modeling file
    module.rotate, module.eager_attention = home.apply_rotary_pos_emb, home.eager_attention_forward
    module.forward = types.MethodType(forward, module)


def _attend(self, query, key, value, attention_mask, cache, input_shape, **kwargs):
    """Rotary embedding, cache update and the attention interface, as transformers' forwards
    do them; returns the attention output as [*input_shape, heads * head_dim] and the weights."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    cos, sin = kwargs.pop("position_embeddings")
    query, key = self.rotate(query, key, cos, sin)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                      self.eager_attention)
    output, weights = attention(self, query, key, value, attention_mask, dropout=0.0,
                                scaling=self.scaling,
                                sliding_window=getattr(self, "sliding_window", None), **kwargs)
    return output.reshape(*input_shape, -1).contiguous(), weights


def fused_forward(self: nn.Module, hidden_states: torch.Tensor,
                  position_embeddings: tuple[torch.Tensor, torch.Tensor],
                  attention_mask: torch.Tensor | None, cache: Cache | None = None,
                  **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention forward (Qwen2/Qwen3/Llama) with one q/k/v matmul."""
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query, key, value = self.qkv_proj(hidden_states).split(self.qkv_sizes, dim=-1)
    query, key, value = query.view(hidden_shape), key.view(hidden_shape), value.view(hidden_shape)
    if getattr(self, "q_norm", None) is not None:  # Qwen3 normalizes each head
        query, key = self.q_norm(query), self.k_norm(key)
    output, weights = _attend(self, query.transpose(1, 2), key.transpose(1, 2),
                              value.transpose(1, 2), attention_mask, cache, input_shape,
                              position_embeddings=position_embeddings, **kwargs)
    return self.o_proj(output), weights


def gated_forward(self: nn.Module, hidden_states: torch.Tensor,
                  position_embeddings: tuple[torch.Tensor, torch.Tensor],
                  attention_mask: torch.Tensor | None, cache: Cache | None = None,
                  **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' gated attention forward (Qwen3.5, Qwen3-Next: each head's query comes with
    a gate of the same size, applied to the attention's output) with one q/k/v matmul."""
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query_gate, key, value = self.qkv_proj(hidden_states).split(self.qkv_sizes, dim=-1)
    query, gate = torch.chunk(query_gate.view(*input_shape, -1, self.head_dim * 2), 2, dim=-1)
    gate = gate.reshape(*input_shape, -1)
    query = self.q_norm(query.view(hidden_shape)).transpose(1, 2)
    key = self.k_norm(key.view(hidden_shape)).transpose(1, 2)
    value = value.view(hidden_shape).transpose(1, 2)
    output, weights = _attend(self, query, key, value, attention_mask, cache, input_shape,
                              position_embeddings=position_embeddings, **kwargs)
    return self.o_proj(output * torch.sigmoid(gate)), weights
