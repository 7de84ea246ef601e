"""The recurrent state of linear-attention layers (Qwen3.5's and Qwen3-Next's Gated DeltaNet):
one slot per row of the batch, beside the paged KV cache of the full-attention layers.

A linear-attention layer carries two states from token to token instead of a growing cache:
the last few inputs of its causal convolution ([conv_dim, kernel]) and the delta rule's state
([value_heads, key_dim, value_dim], float32 as transformers and fla keep it). They do not grow
with the context, so each row has one fixed slot in a [rows + staging, ...] tensor per layer
(the staging slots are where prompts are prefilled, before they have a row: one, or one per
prompt of a prefill of several); a decode step reads and writes
the slots of rows [0, b) in place (views of persistent tensors, so a captured graph replays
it), a row that leaves hands its slot to the row that moves into its place, as the block table
does.

The model's own layers do the work (transformers' torch implementations on the CPU, fla's
kernels where they are installed): they find their states through the `cache` argument of the
forward, which `StateView` answers for a span of slots. Its attention layers' `cache.update`
passes the keys and values through: paged_attention writes them to the KV cache's pools.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.cache_utils import Cache

# Linear-attention modules whose forward reads and writes its states through the cache calls
# StateView answers (transformers 5.24).
KNOWN = {"Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen3NextGatedDeltaNet"}


def linear_layers(model: PreTrainedModel) -> dict[int, torch.nn.Module]:
    """{layer index: module} of the model's known linear-attention layers."""
    return {m.layer_idx: m for m in model.modules() if type(m).__name__ in KNOWN}


class LinearStates:
    """The conv and recurrent states of every linear-attention layer, rows + staging slots
    each."""

    def __init__(self, probe: Cache, rows: int, staging: int = 1):
        self.rows = rows
        self.prefill_slot = rows  # the first staging slot: a prompt prefilled by itself
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(probe.layers):
            conv = getattr(layer, "conv_states", {}).get(0) if hasattr(layer, "conv_states") \
                else None
            if conv is None:
                continue
            recurrent = layer.recurrent_states[0]
            self.conv[index] = conv.new_zeros(rows + staging, *conv.shape[1:])
            self.recurrent[index] = recurrent.new_zeros(rows + staging, *recurrent.shape[1:])
        self._views: dict[tuple[int, int, bool], StateView] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (*self.conv.values(), *self.recurrent.values()))

    def view(self, start: int, count: int, *, fresh: bool = False) -> StateView:
        """The `cache` of a forward over slots [start, start + count); `fresh`: a prompt's
        first chunk, which starts from no state."""
        key = (start, count, fresh)
        if key not in self._views:
            self._views[key] = StateView(self, start, count, fresh)
        return self._views[key]

    def prefill_view(self, fresh: bool) -> StateView:
        return self.view(self.prefill_slot, 1, fresh=fresh)

    def staging_view(self, count: int) -> StateView:
        """The `cache` of a prefill of `count` prompts together, from no state."""
        return self.view(self.prefill_slot, count, fresh=True)

    def place(self, row: int, staged: int = 0) -> None:
        """The prompt just prefilled in staging slot `staged` takes row `row`'s slots."""
        self.copy(self.prefill_slot + staged, row)

    def copy(self, src: int, dst: int) -> None:
        for states in (self.conv, self.recurrent):
            for tensor in states.values():
                tensor[dst].copy_(tensor[src])


class StateView:
    """What the layers of one forward see as its `cache` (the calls transformers' Gated DeltaNet
    and attention layers make), over slots [start, start + count) of LinearStates."""

    # The slots handed out are the states themselves (contiguous views of the persistent
    # tensors): a layer may update them where they are (layers/gated_delta.py) instead of
    # returning new ones for update_recurrent_state to copy in.
    updates_in_place = True

    def __init__(self, states: LinearStates, start: int, count: int, fresh: bool):
        self.fresh = fresh
        # Mid-prompt snapshot (state_snapshots.py): after `keep_at` tokens of this forward, a
        # layer that can split its recurrence there (layers/gated_delta.py) writes its states
        # into `keep_into`, so that the prompt needs no forward that ends at that point.
        self.keep_at = 0
        self.keep_into: tuple[dict, dict] | None = None
        self.conv = {i: t[start:start + count] for i, t in states.conv.items()}
        self.recurrent = {i: t[start:start + count] for i, t in states.recurrent.items()}

    # -- attention layers: their keys and values go to the paged cache ------------------------
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return key_states, value_states

    # -- linear-attention layers --------------------------------------------------------------
    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return None if self.fresh else self.conv[layer_idx]

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return None if self.fresh else self.recurrent[layer_idx]

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        """A multi-token forward's conv input: the state keeps its last `kernel` columns
        (zero-padded on the left for a shorter fresh prompt); returned with the previous state
        in front when there is one, so the convolution sees its left context (as transformers'
        LinearAttentionLayer does)."""
        state = self.conv[layer_idx]
        kernel = state.shape[-1]
        if self.fresh:
            full = conv_states
            padded = F.pad(full, (max(0, kernel - full.shape[-1]), 0))
        else:
            full = padded = torch.cat([state, conv_states.to(state.dtype)], dim=-1)
        state.copy_(padded[..., -kernel:])
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int,
                               state_idx: int = 0, **kwargs) -> torch.Tensor:
        state = self.recurrent[layer_idx]
        if recurrent_states is not state:
            state.copy_(recurrent_states)
        return state

    def keep(self, layer_idx: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """A layer's states at keep_at, into the snapshot."""
        conv_into, recurrent_into = self.keep_into
        conv_into[layer_idx].copy_(conv)
        recurrent_into[layer_idx].copy_(recurrent)

    def get_seq_length(self, layer_idx: int = 0) -> int:  # positions are always given
        return 0
