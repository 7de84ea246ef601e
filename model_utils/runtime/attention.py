"""Decode attention that reads each KV head once, also inside a compiled step.

A grouped-query model (Qwen2.5-7B: 28 query heads share 4 KV heads) decoding one token with a
mask makes transformers' sdpa either pack the query heads of a KV head together (eager) or, under
torch.compile, repeat every KV head for each of its query heads (`repeat_kv`): a copy of the whole
KV window of every layer, written and read again on every step. For the batched cache (32 rows x
1024 slots) that copy moves about as many bytes as the weights themselves.

`packed_sdpa` packs the query heads in both cases; everything else (prefill, no mask, no groups)
is transformers' own sdpa, unchanged. It is registered under its own attention name, with sdpa's
mask function, so the model builds exactly the masks it builds for sdpa.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

NAME = "sdpa_packed_gqa"


def packed_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if query.shape[2] != 1 or groups == 1 or attention_mask is None \
            or not isinstance(attention_mask, torch.Tensor) or dropout \
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    batch, heads, _, dim = query.shape
    # [b, heads, 1, d] -> [b, kv_heads, group, d]: a KV head's query heads act as its queries;
    # the mask [b, 1, 1, w] broadcasts over them.
    packed = query.reshape(batch, heads // groups, groups, dim)
    if query.is_cuda and batch <= MATMUL_ROWS:
        out = _matmul_attention(packed, key, value, attention_mask, scaling)
    else:
        out = F.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask,
                                             scale=scaling)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


# On a GPU, up to this many rows, two batched matmuls and a softmax beat the fused SDPA kernel: with one
# query token per KV head group there are only b x kv_heads blocks of work, too few to fill an
# H200 (cuDNN's kernel took 23.7 us per layer for one row and 1024 slots). Measured there on
# the Qwen2.5-7B shape, one decode step: 1 row 7.05 vs 7.22 ms (plain forward), 5.11 vs
# ~5.4 ms (compiled); 8 rows 7.61 vs 7.69 ms; 32 rows 8.60 vs 8.21 ms, where SDPA wins.
MATMUL_ROWS = 8


def _matmul_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      mask: torch.Tensor, scaling: float | None) -> torch.Tensor:
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    # Scores in fp32, as fused attention kernels keep them: a bf16 product rounded every score
    # to 8 bits of mantissa before the softmax, which put this path's error against an fp32
    # model above plain sdpa's (tests/gpu's logit error ratio).
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scaling
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:  # an additive float mask
        scores = scores + mask
    return torch.matmul(scores.softmax(-1).to(value.dtype), value)


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, packed_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def use_packed_decode(model: PreTrainedModel) -> bool:
    """Switch an sdpa model to packed_sdpa (same results, less memory traffic when compiled).
    Returns whether it applies; a model that refuses the switch (one whose attention does not
    go through transformers' attention interface) keeps plain sdpa."""
    if model.config._attn_implementation != "sdpa":
        return False
    register()
    try:
        model.set_attn_implementation(NAME)
    except Exception as error:  # noqa: BLE001 - an optimization, never a reason to fail a load
        log.info("keeping sdpa attention: %s", error)
        return False
    return model.config._attn_implementation == NAME
