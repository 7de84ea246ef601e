"""Linear-attention states kept at a prompt's block boundary, so that a later prompt starting
with the same tokens (a conversation's next turn) starts from the cache as on an
attention-only model.

An attention layer's cache of a prefix is its blocks; a linear-attention layer has no such
thing, only its state after the last token it read (linear_states.py). So, as vLLM's hybrid
cache manager does, the state is copied aside at one point of each prompt: the last block
boundary at least SNAPSHOT_MARGIN tokens before the prompt's end. The next turn of a
conversation re-renders the earlier turns as they were, but a chat template may write the end
of the last prompt (the assistant's opening, an empty reasoning block) otherwise in the
history, so the point is kept clear of the prompt's last tokens. A snapshot is named like the
block that ends there (kv_blocks.prefix_key): a prompt whose matched blocks reach that name
starts there, with the KV of the blocks and the states of the snapshot.

Snapshots live in `count` slots per layer, least recently used evicted first.
"""

from __future__ import annotations

from collections import OrderedDict

from .linear_states import LinearStates

# The snapshot point's distance from the prompt's end, at least (tokens).
SNAPSHOT_MARGIN = 16
# Share of the memory free beside the KV cache that the snapshots may take.
SNAPSHOT_MEMORY_SHARE = 0.1


def snapshot_point(prompt_tokens: int, block_tokens: int) -> int:
    """Where a prompt's states are kept: a block boundary, 0 for none."""
    return max(0, (prompt_tokens - SNAPSHOT_MARGIN) // block_tokens * block_tokens)


class StateSnapshots:
    """Copies of the linear layers' states of one slot of LinearStates, by prefix name."""

    def __init__(self, states: LinearStates, count: int):
        self.states = states
        self.conv = {i: t.new_zeros(count, *t.shape[1:]) for i, t in states.conv.items()}
        self.recurrent = {i: t.new_zeros(count, *t.shape[1:])
                          for i, t in states.recurrent.items()}
        self._slots: OrderedDict[int, int] = OrderedDict()  # prefix name -> slot, LRU first
        self._free = list(range(count - 1, -1, -1))
        self.saved = self.restored = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (*self.conv.values(), *self.recurrent.values()))

    @staticmethod
    def slot_bytes(states: LinearStates) -> int:
        """Bytes of one snapshot of `states`."""
        return sum(t[0].numel() * t.element_size()
                   for t in (*states.conv.values(), *states.recurrent.values()))

    def __contains__(self, name: int) -> bool:
        return name in self._slots

    def save(self, name: int, slot: int) -> None:
        """Keep the states of LinearStates' slot `slot` under `name`."""
        index = self._reserve(name)
        self._copy((self.states.conv, self.states.recurrent), slot,
                   (self.conv, self.recurrent), index)
        self.saved += 1

    def target(self, name: int) -> tuple[dict, dict]:
        """({layer: conv state}, {layer: recurrent state}) of the snapshot `name`, to be
        written by the forward that passes its point (layers/gated_delta.py keeps them there
        mid-prompt, linear_states.StateView.keep). If that forward fails, `discard(name)`:
        the slot holds no states of that prefix."""
        index = self._reserve(name)
        self.saved += 1
        return ({i: t[index:index + 1] for i, t in self.conv.items()},
                {i: t[index:index + 1] for i, t in self.recurrent.items()})

    def _reserve(self, name: int) -> int:
        if name in self._slots:
            self._slots.move_to_end(name)
            return self._slots[name]
        index = self._free.pop() if self._free else self._slots.popitem(last=False)[1]
        self._slots[name] = index
        return index

    def restore(self, name: int, slot: int) -> bool:
        """Put the states kept under `name` into LinearStates' slot `slot`; False if none."""
        index = self._slots.get(name)
        if index is None:
            return False
        self._slots.move_to_end(name)
        self._copy((self.conv, self.recurrent), index,
                   (self.states.conv, self.states.recurrent), slot)
        self.restored += 1
        return True

    def discard(self, name: int) -> None:
        """Forget the snapshot `name` (its forward failed before writing it whole)."""
        index = self._slots.pop(name, None)
        if index is not None:
            self._free.append(index)
            self.saved -= 1

    def clear(self) -> None:
        self._free.extend(self._slots.values())
        self._slots.clear()

    @staticmethod
    def _copy(sources: tuple[dict, dict], src: int, targets: tuple[dict, dict],
              dst: int) -> None:
        for source, target in zip(sources, targets):
            for layer, tensor in source.items():
                target[layer][dst].copy_(tensor[src])


def snapshot_count(rows: int, slot_bytes: int, free_bytes: int) -> int:
    """Snapshots kept for a runner of `rows` rows: two conversations' worth per row, as far as
    SNAPSHOT_MEMORY_SHARE of the free memory allows (at least one)."""
    return max(1, min(2 * rows, int(free_bytes * SNAPSHOT_MEMORY_SHARE) // max(1, slot_bytes)))
