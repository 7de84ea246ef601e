"""The attention of the batched path: every layer writes its new keys and values into the paged
KV cache (kv_cache.PagedKV) and attends over what the block table says is each row's.

It is registered with transformers as an attention implementation, so the model's own forward
(its projections, rotary embedding, norms, fused q/k/v) runs unchanged; what this forward is
doing comes with it as the `paged` keyword argument (a PagedStep), which transformers passes
from the model's forward down to every attention call. Three kinds of forward:

    decode   one new token per row: decode_kernel (Triton) on a GPU, reference_decode (torch)
             elsewhere; rows of any lengths in one step, each reading its own tokens only
    prefill  prompts that start at position 0, right-padded to one length: causal sdpa over
             their own new keys; padding tokens write to the null block
    extend   one prompt whose first `prefix` tokens are in the cache already (a reused prefix,
             or the earlier chunks of a long prompt): its new tokens attend to the cached ones
             and to each other, causally aligned at the bottom right

Without `paged` (plain model.generate on the same loaded model, a fine-tuning step) it is
transformers' sdpa, unchanged.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

NAME = "paged_sdpa"


@dataclass(eq=False)
class PagedStep:
    """What one forward writes and reads in the paged cache (see the module docstring).

    keys/values: per layer index, the layer's pool [blocks, page, kv_heads, d] (None for a layer
    without attention). slots: [tokens] int64, where each new token's K/V goes, the forward's
    tokens in row-major order. For decode: table [b, width] int32 block numbers and lengths [b]
    int32 (tokens each row attends to, the new one included); max_splits for the kernel (fixed
    per captured shape) and split_tokens [1] int32 (the fewest tokens one of its programs
    takes, set for each step); longest, a host bound on lengths for the reference path. For
    extend: context [prefix + new] int64, the slots of all the row's tokens in order."""

    kind: str
    keys: list[torch.Tensor | None]
    values: list[torch.Tensor | None]
    slots: torch.Tensor
    table: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    max_splits: int = 1
    split_tokens: torch.Tensor | None = None
    longest: int = 0
    context: torch.Tensor | None = None
    prefix: int = 0
    id: int = 0  # a decode step's, by which its attention layers find it (register_step)
    # Devices other than the slots' one (a model split over GPUs), the metadata copied there
    _moved: dict = field(default_factory=dict)

    def on(self, device: torch.device) -> PagedStep:
        """The metadata on `device` (the layer's), copied once per forward per device."""
        if device == self.slots.device:
            return self
        if device not in self._moved:
            def move(t):
                return None if t is None else t.to(device)

            self._moved[device] = PagedStep(
                self.kind, self.keys, self.values, move(self.slots), move(self.table),
                move(self.lengths), self.max_splits, move(self.split_tokens), self.longest,
                move(self.context), self.prefix, self.id)
        moved = self._moved[device]
        moved.longest = self.longest
        return moved


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                    scaling: float | None = None, paged: PagedStep | None = None,
                    **kwargs) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if paged is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    layer = module.layer_idx
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window = kwargs.get("sliding_window") or 0
    if paged.kind == "decode":  # one op: see decode_layer
        out = torch.ops.qwen_chat.paged_decode_layer(query, key, value, paged.id, layer, scale,
                                                     window)
        return out[:, None], None  # [b, 1, q_heads, d]
    step = paged.on(paged.keys[layer].device)
    flat_k, flat_v = store(key, value, step, layer)
    if step.kind == "prefill":
        new = query.shape[2]
        mask = attention_mask  # left padding's (left_padded_prefill.py); else causal
        if mask is None and window and new > window:
            mask = _window_mask(new, new, 0, window, query.device)
        return sdpa_attention_forward(module, query, key, value, mask, scaling=scale,
                                      is_causal=mask is None)
    if step.kind == "extend":
        return _extend(module, query, flat_k, flat_v, step, scale, window)
    raise ValueError(f"unknown paged forward {step.kind!r}")


def store(key: torch.Tensor, value: torch.Tensor, step: PagedStep,
          layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Write a forward's new keys and values ([b, kv_heads, new, d]) to their slots; returns
    the layer's pools as [slots, kv_heads, d]. Written first: every kind then reads the new
    tokens from the pool like the others."""
    batch, kv_heads, new, dim = key.shape
    flat_k = step.keys[layer].view(-1, kv_heads, dim)
    flat_v = step.values[layer].view(-1, kv_heads, dim)
    flat_k.index_copy_(0, step.slots, key.transpose(1, 2).reshape(batch * new, kv_heads, dim))
    flat_v.index_copy_(0, step.slots, value.transpose(1, 2).reshape(batch * new, kv_heads, dim))
    return flat_k, flat_v


# The decode steps' PagedSteps by id: how decode_layer finds its cache (see there).
_STEPS: weakref.WeakValueDictionary[int, PagedStep] = weakref.WeakValueDictionary()
_STEPS_LOCK = threading.Lock()


def register_step(step: PagedStep) -> PagedStep:
    """Give a decode PagedStep the id its forward's attention layers find it by: the smallest
    id no live step holds. torch.compile takes the id into the compiled step as a constant, so
    the steps of a later load, registered in the same order once the unloaded model's are gone,
    get the same ids and the code compiled for that earlier load serves them
    (runtime/compiled_code.py); two caches alive at once never share an id."""
    with _STEPS_LOCK:
        step.id = next(i for i in itertools.count(1) if i not in _STEPS)
        _STEPS[step.id] = step
    return step


@torch.library.custom_op("qwen_chat::paged_decode_layer", mutates_args=())
def decode_layer(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, step_id: int,
                 layer: int, scale: float, window: int) -> torch.Tensor:
    """One decode step's attention in one layer, its cache write included: [b, q_heads, d].

    One op that torch.compile does not look into, which finds the layer's cache by the step's
    id rather than taking it as an argument, as vLLM's attention op does: a compiled step that
    writes into a cache it was given as an input must, for the compiler, produce a new value of
    that input, and a copy of a pool is a copy of every reply's keys."""
    step = _STEPS[step_id].on(query.device)
    flat_k, flat_v = store(key, value, step, layer)
    keys, values = step.keys[layer], step.values[layer]
    if query.is_cuda and _kernel() is not None:
        return _kernel().paged_decode(query[:, :, 0], keys, values, step.table, step.lengths,
                                      step.split_tokens, scale, window, step.max_splits)
    return reference_decode(query[:, :, 0], keys, values, step.table, step.lengths, scale,
                            window, longest=step.longest or step.table.shape[1] * keys.shape[1])


@decode_layer.register_fake
def _(query, key, value, step_id, layer, scale, window):
    return query.new_empty(query.shape[0], query.shape[1], query.shape[3])


def reference_decode(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     table: torch.Tensor, lengths: torch.Tensor, scale: float, window: int = 0,
                     *, longest: int) -> torch.Tensor:
    """What decode_kernel.paged_decode computes, in torch: each row's first `longest` positions
    gathered through its block table, the ones past its length masked, one sdpa with a KV
    head's query heads as its queries. Masked positions are read from the null block: a slot
    never written may hold NaN bits (the pools are not zeroed), and 0 x NaN is NaN."""
    b, q_heads, dim = query.shape
    _, page, kv_heads, _ = keys.shape
    position = torch.arange(longest, device=query.device)
    lengths = lengths.to(torch.long)[:, None]
    mask = position[None] < lengths
    if window:
        mask &= position[None] >= lengths - window
    blocks = table[:, :-(-longest // page)].long()
    slots = blocks.repeat_interleave(page, 1)[:, :longest] * page + position % page
    slots = torch.where(mask, slots, 0)  # the null block's first slot: finite
    k = keys.view(-1, kv_heads, dim)[slots].transpose(1, 2)  # [b, kv_heads, longest, d]
    v = values.view(-1, kv_heads, dim)[slots].transpose(1, 2)
    grouped = query.reshape(b, kv_heads, q_heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask[:, None, None, :],
                                         scale=scale)
    return out.reshape(b, q_heads, dim)


def _extend(module, query, flat_k, flat_v, step: PagedStep, scale: float,
            window: int) -> tuple[torch.Tensor, None]:
    """One prompt's new tokens (query [1, q_heads, new, d]) over all its tokens so far."""
    from torch.nn.attention.bias import causal_lower_right

    new, total = query.shape[2], step.context.shape[0]
    k = flat_k.index_select(0, step.context).transpose(0, 1)[None]  # [1, kv_heads, total, d]
    v = flat_v.index_select(0, step.context).transpose(0, 1)[None]
    if window and total > window:
        mask = _window_mask(new, total, total - new, window, query.device)
    else:
        mask = causal_lower_right(new, total)
    # Grouped heads as they are: flash attention reads each KV head once for its group, where
    # repeat_interleave would copy the whole context once per query head, in every layer.
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=query.shape[1] != k.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _window_mask(new: int, total: int, offset: int, window: int,
                 device: torch.device) -> torch.Tensor:
    """[1, 1, new, total] bool: query i (at position offset + i) sees keys (p - window, p]."""
    q = torch.arange(new, device=device)[:, None] + offset
    k = torch.arange(total, device=device)[None]
    return ((k <= q) & (k > q - window))[None, None]


_KERNEL: object = False  # not looked for yet


def _kernel():
    """decode_kernel, imported on first use where Triton is there (None where it is not)."""
    global _KERNEL
    if _KERNEL is False:
        try:
            from . import decode_kernel
        except ImportError as error:  # a CUDA build of torch without Triton
            log.warning("no Triton (%s): decode attention runs on the torch reference", error)
            decode_kernel = None
        _KERNEL = decode_kernel
    return _KERNEL


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, paged_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def use_paged_attention(model: PreTrainedModel) -> bool:
    """Switch an sdpa model to paged_attention (the same as sdpa where no PagedStep is given).
    Returns whether it applies; a model that refuses the switch keeps plain sdpa and its
    replies take the single-stream path."""
    if model.config._attn_implementation not in ("sdpa", NAME):
        return False
    register()
    try:
        model.set_attn_implementation(NAME)
    except Exception as error:  # noqa: BLE001 - an optimization, never a reason to fail a load
        log.info("keeping sdpa attention: %s", error)
        return False
    return model.config._attn_implementation == NAME
