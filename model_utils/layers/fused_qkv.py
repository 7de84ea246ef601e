"""One matmul for an attention layer's query, key and value projections.

Decoding one token, each projection is a matrix-vector product, and the key and value ones are
small (Qwen2.5-7B: 3584 x 512): too small to reach the GPU's memory bandwidth, each costs a
kernel of fixed latency plus cuBLAS's split-K reduction (6-9 us each on the H200,
benchmarks/HISTORY.md).
Concatenating the three weights into one [q + k + v, hidden] matrix makes them one product of the
size of the query's alone.

Applied only to attention classes whose forward is known (below), by giving those modules a
forward that is transformers' own with the three projections replaced by one and a split; the
tests compare it with the original forward. The weights are moved, not copied: memory stays the
same.
"""

from __future__ import annotations

import logging
import sys
import types
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers.cache_utils import Cache

log = logging.getLogger(__name__)

# Attention classes whose forward fused_forward reproduces (transformers 5.24): projections, an
# optional per-head q/k RMSNorm (Qwen3), rotary embedding, cache update, the attention interface.
FUSABLE = {"Qwen2Attention", "Qwen3Attention", "LlamaAttention"}


def fuse_qkv(model: nn.Module) -> int:
    """Fuse every fusable attention layer of `model` in place; returns how many were fused."""
    fused = 0
    for module in model.modules():
        if type(module).__name__ in FUSABLE and _plain_projections(module):
            _fuse(module)
            fused += 1
    if fused:
        log.info("fused the q/k/v projections of %d attention layers", fused)
    return fused


def _plain_projections(module: nn.Module) -> bool:
    """Three plain nn.Linear on one device and dtype (not bitsandbytes layers, which subclass
    nn.Linear, nor layers whose weights accelerate offloads), all with or all without bias."""
    layers = [getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj")]
    if not all(type(layer) is nn.Linear for layer in layers):
        return False
    weights = [layer.weight for layer in layers]
    if any(w.device.type == "meta" for w in weights) or len({(w.device, w.dtype) for w in weights}) > 1:
        return False
    return len({layer.bias is None for layer in layers}) == 1


def _fuse(module: nn.Module) -> None:
    q, k, v = module.q_proj, module.k_proj, module.v_proj
    with torch.no_grad():
        fused = nn.Linear(q.in_features, q.out_features + k.out_features + v.out_features,
                          bias=q.bias is not None, device="meta")
        fused.weight = nn.Parameter(torch.cat([q.weight, k.weight, v.weight]), requires_grad=False)
        if q.bias is not None:
            fused.bias = nn.Parameter(torch.cat([q.bias, k.bias, v.bias]), requires_grad=False)
    module.qkv_sizes = (q.out_features, k.out_features, v.out_features)
    module.qkv_proj = fused
    del module.q_proj, module.k_proj, module.v_proj  # their weights are freed
    home = sys.modules[type(module).__module__]  # the model's modeling file
    module.rotate, module.eager_attention = home.apply_rotary_pos_emb, home.eager_attention_forward
    module.forward = types.MethodType(fused_forward, module)


def fused_forward(self: nn.Module, hidden_states: torch.Tensor,
                  position_embeddings: tuple[torch.Tensor, torch.Tensor],
                  attention_mask: torch.Tensor | None, cache: Cache | None = None,
                  **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention forward (Qwen2/Qwen3/Llama) with one q/k/v matmul."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query, key, value = self.qkv_proj(hidden_states).split(self.qkv_sizes, dim=-1)
    query, key, value = query.view(hidden_shape), key.view(hidden_shape), value.view(hidden_shape)
    if getattr(self, "q_norm", None) is not None:  # Qwen3 normalizes each head
        query, key = self.q_norm(query), self.k_norm(key)
    query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    cos, sin = position_embeddings
    query, key = self.rotate(query, key, cos, sin)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                      self.eager_attention)
    output, weights = attention(self, query, key, value, attention_mask, dropout=0.0,
                                scaling=self.scaling,
                                sliding_window=getattr(self, "sliding_window", None), **kwargs)
    output = output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(output), weights
