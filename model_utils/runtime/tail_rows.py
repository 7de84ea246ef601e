"""A conversation's next turn, when only a short tail of its prompt is new: the tail's tokens
decoded as rows of one captured decode step instead of one eager forward.

Token i of the tail is row i of the step: its position is cached + i and its block table row
is the prompt's blocks, so it attends to the cached tokens and to the tail's tokens before it,
whose keys the same step writes first (paged_attention.decode_layer). Where the step replays
CUDA graphs that is one replay instead of the eager forward's kernels launched one by one,
which cost a next turn a fixed ~40 ms on a 7B model (BENCHMARKS.md). Each row reads the whole
context, so past a few dozen tokens the one-sequence forward is the better one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .kv_cache import PagedKV, bucket

# The most new tokens after a cached start decoded as rows.
TAIL_ROWS = 64


class TailRows:
    """Rows of their own over the cache's pools (PagedKV.with_rows), for `step_fn`."""

    def __init__(self, kv: PagedKV, step_fn: Callable[[PagedKV, int], torch.Tensor],
                 rows: int = TAIL_ROWS):
        self.kv = kv.with_rows(rows)
        self.step_fn = step_fn

    def __call__(self, tokens: list[int], blocks: list[int], cached: int) -> torch.Tensor:
        """Logits [1, V] of the last of `tokens`, whose first `cached` are in `blocks`."""
        tail = self.kv
        new = len(tokens) - cached
        b = bucket(new, tail.row_buckets)
        table = torch.zeros(tail.width, dtype=torch.int32)
        table[:len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        tail.table[:new].copy_(table.to(tail.device, non_blocking=True).expand(new, -1))
        tail.pos[:new].copy_(torch.arange(cached, len(tokens)), non_blocking=True)
        tail.ids[:new, 0].copy_(torch.tensor(tokens[cached:]), non_blocking=True)
        tail.pad_rows(new, b)
        tail.set_lengths(b, len(tokens), sum(range(cached + 1, len(tokens) + 1)) + b)
        logits = self.step_fn(tail, b)[new - 1:new].clone()  # the graph's output is reused
        tail.table[:new].zero_()  # back to the null block: padding rows of later tails
        return logits

    def warm_up(self) -> None:
        """Run (and so capture) the step of the most rows, every row on the null block."""
        b = self.kv.row_buckets[-1]
        self.kv.pad_rows(0, b)
        self.kv.set_lengths(b, 1, b)
        self.step_fn(self.kv, b)
