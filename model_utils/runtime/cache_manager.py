"""The scheduler's view of the KV cache: which blocks each request holds, what it finds of its
prompt already there, and where its next tokens go. Pure Python over kv_blocks.BlockPool.

A request is admitted only when the blocks of its prompt can be had (its reused prefix taken,
the rest allocated) with `headroom` blocks left for the replies already decoding to grow into;
a decoding reply takes a block each time its next token starts one. The blocks of a finished
reply (and of a preempted one) are named by their tokens before they are let go, so that the
conversation's next turn, or the same request resumed, finds them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .kv_blocks import BlockCounts, BlockPool, PrefixMatch, blocks_for

if TYPE_CHECKING:
    from .requests import Request

# How many of a prompt's matched blocks it may start after (see BatchRunner.reusable_blocks).
Reusable = Callable[[PrefixMatch], int]


class CacheManager:
    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.block_tokens = pool.block_size

    def counts(self) -> BlockCounts:
        return self.pool.counts()

    def admit(self, request: Request, *, reuse: bool, headroom: int,
              min_reuse: int = 0, reusable: Reusable | None = None) -> bool:
        """Give `request` the blocks of its prompt (request.prompt_ids): the reused prefix
        (when `reuse` and it covers at least `min_reuse` tokens; only as many of the matched
        blocks as `reusable` allows, all by default) and new ones for the rest. False, taking
        nothing, when fewer than those plus `headroom` blocks can be had."""
        tokens = request.prompt_ids
        match = []
        if reuse:
            found = self.pool.match(tokens)
            match = found.blocks[:reusable(found)] if reusable else found.blocks
        if len(match) * self.block_tokens < min_reuse:
            match = []
        self.pool.take(match)
        need = blocks_for(len(tokens), self.block_tokens) - len(match)
        if self.pool.available() < need + headroom:
            self.pool.release(match)
            return False
        request.blocks = match + self.pool.allocate(need)
        request.cached_tokens = len(match) * self.block_tokens
        self.pool.hits_tokens += request.cached_tokens
        return True

    def computed(self, request: Request) -> None:
        """The prompt's keys and values are in its blocks now: its full blocks can be shared."""
        self.pool.name_blocks(request.blocks, request.prompt_ids)

    def grow(self, rows: list[Request]) -> list[tuple[int, int, int]] | None:
        """A new block for every row whose next token (at position row.length) starts one:
        [(row index, index in its table, block)], or None, taking nothing, when the pool has
        too few."""
        needing = [i for i, r in enumerate(rows)
                   if r.length // self.block_tokens >= len(r.blocks)]
        if not needing:
            return []
        blocks = self.pool.allocate(len(needing))
        if blocks is None:
            return None
        entries = []
        for i, block in zip(needing, blocks):
            entries.append((i, len(rows[i].blocks), block))
            rows[i].blocks.append(block)
        return entries

    def release(self, request: Request, *, keep: bool) -> None:
        """Let go of a request's blocks; with `keep`, its computed tokens stay findable."""
        if keep:
            self.pool.name_blocks(request.blocks, request.cached_sequence())
        self.pool.release(request.blocks)
        request.blocks = []
