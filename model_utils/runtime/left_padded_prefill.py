"""Prompts of a model with linear-attention layers (Qwen3.5, Qwen3-Next) prefilled together,
with fixed shapes so that a CUDA graph replays them: padded on the left.

Right padding (prefill.py) cannot serve these layers: the padding after a prompt would run
through their recurrence, and the state a reply starts from would be the padding's. Padding on
the left can. The layers zero the hidden states of padded positions (the 2-D mask transformers
hands them), and from zero inputs their convolution and delta rule keep a zero state, which is
where a prompt starts anyway. The attention layers get a mask that hides the padding from every
prompt token (a padded position sees itself, so that no row of the softmax is empty and nothing
is NaN); a prompt's positions count from 0 after its padding; the padding's keys and values go
to the null block; every prompt ends at the last position, whose logits are the ones kept.
Each prompt's states land in a staging slot of its own (linear_states.LinearStates), from which
it takes its row.

Prompts that keep a state snapshot (state_snapshots: long enough for a next turn to reuse) are
not taken: the one-by-one prefill stops at their snapshot point.
"""

from __future__ import annotations

import torch

from .kv_blocks import NULL_BLOCK
from .kv_cache import token_slots
from .prefill import PaddedPrefill, PrefillBucket

# Prompt lengths with a graph of their own. Short prompts are the launch-bound ones, and a
# prompt up to 256 tokens never keeps a snapshot at the default minimum reuse.
LEFT_PADDED_BUCKETS = (64, 128, 256)


class LeftPaddedPrefill(PaddedPrefill):
    """PaddedPrefill for models with linear-attention layers (see the module docstring)."""

    def __init__(self, model, kv, *, capture=None, buckets=LEFT_PADDED_BUCKETS):
        super().__init__(model, kv, capture=capture, buckets=buckets)
        self.bucket_type = LeftPaddedBucket

    def __call__(self, prompts: list[list[int]], blocks: list[list[int]]) -> torch.Tensor:
        """Logits [n, V]; prompt i's keys and values are written to blocks[i], its linear
        layers' states to staging slot i."""
        lengths = [len(p) for p in prompts]
        entry = self._entry(self._shape(lengths))
        ids = torch.zeros(entry.rows, entry.size, dtype=torch.long)
        positions = torch.zeros(entry.rows, entry.size, dtype=torch.long)
        slots = torch.full((entry.rows, entry.size), NULL_BLOCK * self.kv.block_tokens,
                           dtype=torch.long)
        real = torch.zeros(entry.rows, entry.size, dtype=torch.bool)
        for row, (prompt, held) in enumerate(zip(prompts, blocks)):
            start = entry.size - len(prompt)
            ids[row, start:] = torch.tensor(prompt)
            positions[row, start:] = torch.arange(len(prompt))
            slots[row, start:] = torch.tensor(
                token_slots(held, 0, len(prompt), self.kv.block_tokens))
            real[row, start:] = True
        entry.ids.copy_(ids, non_blocking=True)
        entry.positions.copy_(positions, non_blocking=True)
        entry.slots.copy_(slots.view(-1), non_blocking=True)
        entry.real.copy_(real, non_blocking=True)
        return entry.run()[:len(prompts)]


class LeftPaddedBucket(PrefillBucket):
    """The persistent inputs of one shape, with which positions hold a prompt token (`real`;
    none until a prompt is given, so the warm-up writes nowhere that matters)."""

    def __init__(self, owner: LeftPaddedPrefill, rows: int, size: int):
        super().__init__(owner, rows, size)
        device = owner.kv.device
        self.real = torch.zeros(rows, size, dtype=torch.bool, device=device)
        self.itself = torch.eye(size, dtype=torch.bool, device=device)
        self.causal = torch.ones(size, size, dtype=torch.bool, device=device).tril()
        self.states = owner.kv.states.staging_view(rows)

    def forward(self) -> torch.Tensor:
        """Logits [rows, V] of each row's last position."""
        attention = (self.causal & self.real[:, None, :]) | self.itself  # [rows, q, k]
        masks = {kind: attention[:, None] for kind in self.no_masks}
        masks["linear_attention"] = self.real
        return self.model(input_ids=self.ids, position_ids=self.positions,
                          attention_mask=masks, paged=self.step, use_cache=False,
                          logits_to_keep=1, cache=self.states).logits[:, -1]
