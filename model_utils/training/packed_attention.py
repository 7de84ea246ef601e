"""Attention over packed training rows with flash varlen: each example attends to itself only,
with no mask tensor.

Packed rows hold several examples back to back. transformers' sdpa path keeps them apart with a
block-diagonal (batch, 1, seq, seq) mask, which rules out sdpa's flash kernel and repeats the
key/value heads for GQA. torch's `varlen_attn` takes the rows flattened to (tokens, heads, dim)
and the examples' boundaries (cumulative lengths) instead, which is what flash attention was
built for. It is registered with transformers' AttentionInterface under NAME, so the decoder's
own attention modules call it; the boundaries reach it as the `cu_seq_lens_q` / `max_length_q`
keyword arguments that transformers forwards to every attention call.

CUDA only (flash kernels); `available()` says whether this torch has it.
"""

from __future__ import annotations

import inspect
from functools import lru_cache

import torch

NAME = "packed_varlen"


@lru_cache(maxsize=1)
def _varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, frozenset()
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def available(device: torch.device) -> bool:
    return device.type == "cuda" and _varlen()[0] is not None


def varlen_kwargs(position_ids: torch.Tensor) -> dict:
    """The boundaries of a packed batch (every restart of the position ids begins an example;
    a row's tail of pads is one more), as the keyword arguments transformers forwards."""
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(position_ids)
    longest = int(max_q)  # one sync a micro-batch; the kernel takes a Python int
    return {"cu_seq_lens_q": cu_q, "cu_seq_lens_k": cu_k, "max_length_q": longest,
            "max_length_k": longest}


def packed_varlen_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                          scaling: float | None = None, cu_seq_lens_q=None, max_length_q=None,
                          **kwargs):
    """transformers' attention-function signature: (batch, heads, seq, dim) in,
    (batch, seq, heads, dim) and no weights out."""
    if cu_seq_lens_q is None or max_length_q is None:
        raise ValueError(f"attention '{NAME}' needs cu_seq_lens_q and max_length_q "
                         "(the packed batch's example boundaries)")
    if dropout:
        raise ValueError(f"attention '{NAME}' has no dropout; train with attention dropout 0")
    varlen_attn, params = _varlen()
    if query.dtype not in (torch.float16, torch.bfloat16):
        # Flash takes half precision only. QLoRA's fp32 layer norms (peft's
        # prepare_model_for_kbit_training) hand it fp32 under autocast; sdpa would be autocast
        # to the same half dtype there.
        half = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") \
            else torch.bfloat16
        query, key, value = query.to(half), key.to(half), value.to(half)
    batch, heads, seq, dim = query.shape
    kv_heads = key.shape[1]
    q = query.transpose(1, 2).reshape(batch * seq, heads, dim)
    k = key.transpose(1, 2).reshape(batch * seq, kv_heads, dim)
    v = value.transpose(1, 2).reshape(batch * seq, kv_heads, dim)
    extra = {}
    if kv_heads != heads:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:  # older torch: the kernel wants equal head counts
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
    if "is_causal" in params:  # torch 2.9's signature
        extra["is_causal"] = True
    else:
        extra["window_size"] = (-1, 0)
    cu = cu_seq_lens_q.to(device=q.device, dtype=torch.int32)
    out = varlen_attn(q, k, v, cu, cu, int(max_length_q), int(max_length_q), scale=scaling,
                      **extra)
    return out.view(batch, seq, heads, dim), None


def use_packed_varlen(model: torch.nn.Module) -> None:
    """Route `model`'s attention (a transformers model, peft-wrapped or not) through NAME."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, packed_varlen_forward)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    # Every attention module reads config._attn_implementation at each call; sub-configs
    # (text_config of multimodal wrappers) share the setting through set_attn_implementation.
    try:
        base.set_attn_implementation(NAME)
    except (AttributeError, ValueError, KeyError):
        base.config._attn_implementation = NAME
