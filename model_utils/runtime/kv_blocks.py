"""Which KV blocks hold what: the block pool every reply's cache is cut from, and prefix reuse.

Pure Python, no tensors: the scheduler decides with it, the runner (kv_cache.PagedKV) holds
the memory the block numbers index. The design is vLLM's (its KV-cache manager with automatic
prefix caching) at this app's scale:

- The cache is `num_blocks` blocks of `block_size` token slots. A reply holds the blocks its
  tokens fill, in order (its block table); memory follows the tokens that exist, not rows x
  context. Block 0 is never handed out: padding tokens of a padded prefill write there.
- A full block is named by its tokens and everything before them (a hash of the parent block's
  name and its own token ids; the ids are kept too and compared, so a hash collision can never
  hand out a wrong block). Named blocks are shared read-only: a new prompt that starts with the
  tokens of named blocks takes those blocks (a reference each) instead of computing them again.
  Only full blocks are named and shared, so a shared block is never written again.
- A block nobody references any more goes back to the free list, or, when it is named, to the
  cached list: still findable by its name, evicted least-recently-used when a block is needed
  and the free list is empty.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

NULL_BLOCK = 0  # never allocated: where padding writes, what an unused table entry points at


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that `tokens` token slots take."""
    return -(-tokens // block_size)


@dataclass
class _Named:
    key: int  # hash of (parent key, tokens)
    parent: int | None
    tokens: tuple[int, ...]


@dataclass
class BlockCounts:
    total: int  # blocks that can be handed out (the null block not counted)
    used: int  # referenced by at least one reply
    cached: int  # referenced by none, kept for reuse (evictable)
    free: int  # holding nothing
    block_size: int

    @property
    def available(self) -> int:
        """Blocks an allocation can take now: free ones, then cached ones by eviction."""
        return self.free + self.cached

    def as_dict(self) -> dict:
        return {"total": self.total, "used": self.used, "cached": self.cached,
                "free": self.free, "block_tokens": self.block_size}


@dataclass
class PrefixMatch:
    blocks: list[int] = field(default_factory=list)  # full blocks that hold the prompt's start
    keys: list[int] = field(default_factory=list)  # their names: keys[i] ends at block i

    def tokens(self, block_size: int) -> int:
        return len(self.blocks) * block_size


class BlockPool:
    """The blocks of one loaded model's KV cache (see the module docstring). Not thread-safe:
    the scheduler uses it on the decode worker only."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2 or block_size < 1:
            raise ValueError(f"a block pool needs 2 or more blocks of 1 or more tokens, got "
                             f"{num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: list[int] = list(range(num_blocks - 1, NULL_BLOCK, -1))  # pop() -> 1, 2, ...
        self._refs = [0] * num_blocks
        self._named: dict[int, _Named] = {}  # block -> its name
        self._by_key: dict[int, int] = {}  # name key -> block
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced named blocks, LRU first
        self.hits_tokens = 0  # prompt tokens served from the cache since the pool was made
        self.evictions = 0

    # -- what is there ------------------------------------------------------------------------
    def counts(self) -> BlockCounts:
        cached, free = len(self._cached), len(self._free)
        total = self.num_blocks - 1
        return BlockCounts(total=total, used=total - cached - free, cached=cached, free=free,
                           block_size=self.block_size)

    def available(self) -> int:
        return len(self._free) + len(self._cached)

    def refs(self, block: int) -> int:
        return self._refs[block]

    # -- prefix reuse -------------------------------------------------------------------------
    def match(self, tokens: Sequence[int]) -> PrefixMatch:
        """The named blocks that hold the start of `tokens`, in order. At least the last token
        is always left out of the match: its logits must be computed."""
        found: list[int] = []
        keys: list[int] = []
        parent = None
        usable = (len(tokens) - 1) // self.block_size
        for i in range(usable):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            block = self._by_key.get(_key(parent, chunk))
            if block is None:
                break
            named = self._named[block]
            if named.parent != parent or named.tokens != chunk:  # a hash collision
                break
            found.append(block)
            keys.append(named.key)
            parent = named.key
        return PrefixMatch(found, keys)

    def name_blocks(self, blocks: Sequence[int], tokens: Sequence[int]) -> None:
        """Name the full blocks of a sequence whose KV is computed: blocks[i] holds
        tokens[i * block_size:(i + 1) * block_size]. Blocks already named are passed over; a
        block whose name another block has already is left unnamed (it is freed, not cached,
        when its reply lets go of it)."""
        parent = None
        for i in range(min(len(blocks), len(tokens) // self.block_size)):
            block = blocks[i]
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            key = _key(parent, chunk)
            named = self._named.get(block)
            if named is not None:
                if named.key != key:  # not this sequence's block: stop naming here
                    return
                parent = key
                continue
            if key in self._by_key:  # the same tokens are cached in another block
                other = self._named[self._by_key[key]]
                if other.parent != parent or other.tokens != chunk:  # a hash collision
                    return
                parent = key
                continue
            self._named[block] = _Named(key, parent, chunk)
            self._by_key[key] = block
            parent = key

    # -- taking and giving back ---------------------------------------------------------------
    def take(self, blocks: Sequence[int]) -> None:
        """A reference to each of `blocks` (named blocks found by match)."""
        for block in blocks:
            if self._refs[block] == 0:
                self._cached.pop(block, None)
            self._refs[block] += 1

    def allocate(self, count: int) -> list[int] | None:
        """`count` new blocks (one reference each), evicting cached blocks least-recently-used
        when the free list runs out; None, taking nothing, when there are not that many."""
        if count > self.available():
            return None
        out = []
        for _ in range(count):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._cached.popitem(last=False)
                self._forget_name(block)
                self.evictions += 1
            self._refs[block] = 1
            out.append(block)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each of `blocks`. A block left unreferenced is cached when it
        is named (the most recently used last, and a sequence's later blocks are evicted
        before its earlier ones), else freed."""
        for block in reversed(blocks):
            if block == NULL_BLOCK:
                continue
            if self._refs[block] <= 0:
                raise RuntimeError(f"block {block} released more often than taken")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._named:
                    self._cached[block] = None  # the most recently used end
                else:
                    self._free.append(block)

    def clear_cache(self) -> int:
        """Forget every cached block (they become free); returns how many."""
        count = len(self._cached)
        while self._cached:
            block, _ = self._cached.popitem()
            self._forget_name(block)
            self._free.append(block)
        return count

    # -- inside -------------------------------------------------------------------------------
    def _forget_name(self, block: int) -> None:
        named = self._named.pop(block, None)
        if named is not None and self._by_key.get(named.key) == block:
            del self._by_key[named.key]


def prefix_key(tokens: Sequence[int], block_size: int, blocks: int) -> int | None:
    """The name the pool gives the block that ends the first `blocks` full blocks of `tokens`
    (None for none): what a state kept at that point is found by."""
    parent = None
    for i in range(blocks):
        parent = _key(parent, tuple(tokens[i * block_size:(i + 1) * block_size]))
    return parent


def _key(parent: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))
