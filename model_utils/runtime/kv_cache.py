"""The paged KV cache's memory, and the per-row state a decode step reads from the device.

Each attention layer keeps one pool of K and one of V, [blocks, block_tokens, kv_heads, d]; a
reply's tokens live in the blocks its row of the block table names (kv_blocks.BlockPool decides
which, on the host). So memory is taken by the tokens that exist, prompts of any length share
one pool, and a block of a prompt's start can be read by several replies at once.

Rows. Active replies live in rows [0, n) (one that leaves is replaced by the last, which moves
only its table row: no KV is copied); a decode step runs on the first b rows, b from a short
list of buckets, so each b is one fixed shape for a captured CUDA graph. A row's state on the
device: its block table row, `pos` (tokens it has in the cache, which is the position of its
next token), `ids` (that token). The step itself derives where the token goes (`slots`) and how
many tokens each row attends to (`lengths`) from those, on the device, so a captured step reads
and advances them with no host work: the host only writes a table entry when a row's next token
starts a new block (every block_tokens steps).

Rows past the active ones in a step's bucket are padding: their table rows point at the null
block and their position is kept at 0, so they write and read one slot of the null block.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .kv_blocks import NULL_BLOCK, blocks_for
from .linear_states import LinearStates, linear_layers
from .paged_attention import NAME as PAGED_SDPA
from .paged_attention import PagedStep, register_step

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.cache_utils import Cache

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
BLOCK_TOKENS = 16  # vLLM's default: small enough that a shared prefix wastes little
# Layer types the batched path takes: attention over the paged cache, and linear attention
# whose state has a slot per row (linear_states.py) where its module is one of those known.
ATTENTION_LAYERS = {"full_attention", "sliding_attention"}
SUPPORTED_LAYERS = ATTENTION_LAYERS | {"linear_attention"}
ATTENTION = {"sdpa", PAGED_SDPA}  # implementations the paged attention replaces


def bucket(value: int, buckets: tuple[int, ...]) -> int:
    for size in buckets:
        if value <= size:
            return size
    raise ValueError(f"{value} exceeds the largest bucket ({buckets[-1]})")


def layer_types(model: PreTrainedModel) -> list[str]:
    from transformers.cache_utils import get_layer_types_and_kwargs

    return get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))[0]


def support(model: PreTrainedModel) -> tuple[bool, str]:
    """(batched decoding applies, why not) for a loaded model."""
    types = layer_types(model)
    if not set(types) <= SUPPORTED_LAYERS:
        return False, f"layer types {sorted(set(types) - SUPPORTED_LAYERS)} are not batched"
    linear = {i for i, kind in enumerate(types) if kind == "linear_attention"}
    if not linear <= set(linear_layers(model)):
        return False, "its linear-attention layers are of a kind the batched path does not know"
    attention = model.config._attn_implementation
    if attention not in ATTENTION:
        return False, f"attention implementation {attention!r} is not batched"
    return True, ""


@dataclass(frozen=True)
class LayerKV:
    """One attention layer's K/V: shape per token and where it lives."""

    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()


def probe_layers(prompt_cache: Cache) -> list[LayerKV | None]:
    """Each layer's K/V, read off a cache a short prefill filled (the shapes, dtypes and
    devices the model really produces: bitsandbytes' compute dtype, a split model's devices);
    None for a layer without keys (linear attention)."""
    layers = []
    for layer in prompt_cache.layers:
        keys = getattr(layer, "keys", None)
        layers.append(None if keys is None else
                      LayerKV(keys.shape[1], keys.shape[3], keys.dtype, keys.device))
    return layers


class PagedKV:
    """The pools of every layer, the block table and the rows' device state."""

    def __init__(self, model: PreTrainedModel, layers: list[LayerKV | None], *, num_blocks: int,
                 block_tokens: int, rows: int, context_tokens: int, device: torch.device,
                 states: LinearStates | None = None):
        self.num_blocks, self.block_tokens, self.rows = num_blocks, block_tokens, rows
        self.device = device
        self.states = states  # linear attention's, a slot per row (None: no such layers)
        # Table entries per row: every position up to the context, one step past it included.
        self.width = blocks_for(context_tokens + 1, block_tokens)
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []
        for layer in layers:
            if layer is None:  # no keys in this layer
                self.keys.append(None)
                self.values.append(None)
                continue
            shape = (num_blocks, block_tokens, layer.kv_heads, layer.head_dim)
            k = torch.empty(shape, dtype=layer.dtype, device=layer.device)
            v = torch.empty(shape, dtype=layer.dtype, device=layer.device)
            k[NULL_BLOCK].zero_()  # padding reads it: finite
            v[NULL_BLOCK].zero_()
            self.keys.append(k)
            self.values.append(v)
        self.no_masks = {kind: None for kind in set(layer_types(model))}
        self._kv_heads = max(layer.kv_heads for layer in layers if layer is not None)
        self._sms = torch.cuda.get_device_properties(device).multi_processor_count \
            if device.type == "cuda" else 0
        self._make_rows(rows)
        self.may_compile = True  # a compiled step may run on these rows (see with_rows)
        if device.type == "cuda":  # fixed addresses for torch.compile: a compiled step
            pools = [t for t in (*self.keys, *self.values) if t is not None]  # writes into
            for buffer in (*pools, self.table, self.pos, self.ids,  # them in place
                           self.lengths, self.slots, self.split_tokens):
                torch._dynamo.mark_static_address(buffer)

    def _make_rows(self, rows: int) -> None:
        """The rows' device state (see the module docstring), rows [0, rows)."""
        device = self.device
        self.rows = rows
        self.table = torch.zeros(rows, self.width, dtype=torch.int32, device=device)
        self.pos = torch.zeros(rows, dtype=torch.long, device=device)
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.lengths = torch.zeros(rows, dtype=torch.int32, device=device)
        self.slots = torch.zeros(rows, dtype=torch.long, device=device)
        self.split_tokens = torch.full((1,), 1 << 20, dtype=torch.int32, device=device)
        self._split = 0  # split_tokens' value, as the host last wrote it
        self.row_buckets = tuple(b for b in ROW_BUCKETS if b < rows) + (rows,)
        self._steps: dict[int, PagedStep] = {}

    def with_rows(self, rows: int) -> PagedKV:
        """Rows of their own over the same pools (the same blocks), for a model without
        linear layers: what a prompt's new tokens after a cached start are decoded in, each
        token a row (BatchRunner.forward_prompt). Only the plain forward runs on them: a
        compiled step meeting other buffers would compile again."""
        if self.states is not None:
            raise ValueError("rows over the same pools need a model without linear layers")
        other = copy.copy(self)
        other._make_rows(rows)
        other.row_buckets = (rows,)  # one shape: a step of 64 rows reads the weights once,
        other.may_compile = False  # as one of 8 does, so smaller ones would save little
        return other

    @property
    def nbytes(self) -> int:
        pools = sum(t.numel() * t.element_size() for t in self.keys + self.values
                    if t is not None)
        return pools + (self.states.nbytes if self.states else 0)

    # -- a decode step -------------------------------------------------------------------------
    def prepare_decode(self, b: int) -> None:
        """On the device, part of the step (and of its captured graph): each row's write slot
        and attended length, from its table row and position."""
        pos = self.pos[:b]
        index = torch.clamp(pos // self.block_tokens, max=self.width - 1)
        block = self.table[:b].gather(1, index[:, None])[:, 0].long()
        torch.add(block * self.block_tokens, pos % self.block_tokens, out=self.slots[:b])
        torch.add(pos, 1, out=self.lengths[:b])

    def decode_args(self, b: int) -> dict[str, Any]:
        """The forward's keyword arguments for a decode step of rows [0, b): views of
        persistent buffers, so a captured graph reads them in place."""
        step = self._steps.get(b)
        if step is None:
            step = register_step(PagedStep(
                "decode", self.keys, self.values, self.slots[:b], table=self.table[:b],
                lengths=self.lengths[:b], max_splits=decode_splits(b, self._kv_heads, self._sms),
                split_tokens=self.split_tokens))
            self._steps[b] = step
        return dict(input_ids=self.ids[:b], position_ids=self.pos[:b, None],
                    attention_mask=self.no_masks, paged=step, use_cache=False, logits_to_keep=1,
                    **({"cache": self.states.view(0, b)} if self.states else {}))

    def set_lengths(self, b: int, longest: int, total: int) -> None:
        """What the next step's rows attend to: the most tokens of any row (what the torch
        reference gathers) and all rows' tokens together (how the GPU kernel splits them)."""
        self.decode_args(b)["paged"].longest = longest
        if self._sms:
            from .decode_kernel import split_size

            split = split_size(total, self._kv_heads, self._sms)
            if split != self._split:
                self.split_tokens.fill_(split)
                self._split = split

    def advance(self, b: int) -> None:
        self.pos[:b] += 1

    def pad_rows(self, active: int, b: int) -> None:
        """Padding rows [active, b) of a step: back to position 0 (steps move them on too)."""
        if b > active:
            self.pos[active:b] = 0

    # -- prefill -------------------------------------------------------------------------------
    def prefill_step(self, slots: torch.Tensor) -> PagedStep:
        return PagedStep("prefill", self.keys, self.values, slots)

    def extend_step(self, slots: torch.Tensor, context: torch.Tensor, prefix: int) -> PagedStep:
        return PagedStep("extend", self.keys, self.values, slots, context=context, prefix=prefix)

    def slots_of(self, blocks: list[int], start: int, stop: int) -> torch.Tensor:
        """[stop - start] int64 on the device: the slots of positions [start, stop) of a
        sequence held in `blocks`."""
        return torch.tensor(token_slots(blocks, start, stop, self.block_tokens),
                            dtype=torch.long).to(self.device, non_blocking=True)

    # -- rows ----------------------------------------------------------------------------------
    def place(self, row: int, blocks: list[int], length: int, token: int,
              staged: int = 0) -> None:
        """Row `row` holds a sequence of `length` tokens in `blocks`; `token` is its next input
        (with linear-attention layers, its states are in staging slot `staged`)."""
        table = torch.zeros(self.width, dtype=torch.int32)
        table[:len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self.table[row].copy_(table, non_blocking=True)
        self.pos[row] = length
        self.ids[row, 0] = token
        if self.states:  # its prompt was just prefilled in a staging slot
            self.states.place(row, staged)

    def add_blocks(self, entries: list[tuple[int, int, int]]) -> None:
        """(row, index, block): table[row, index] = block, in one small copy."""
        if entries:
            rows, index, blocks = zip(*entries)
            values = torch.tensor(blocks, dtype=torch.int32).to(self.device, non_blocking=True)
            self.table[list(rows), list(index)] = values

    def move_row(self, src: int, dst: int) -> None:
        self.table[dst] = self.table[src]
        self.pos[dst] = self.pos[src]
        self.ids[dst] = self.ids[src]
        if self.states:
            self.states.copy(src, dst)
        self.clear_row(src)

    def clear_row(self, row: int) -> None:
        """A row nobody holds: it points at the null block (it may be a padding row next)."""
        self.table[row].zero_()
        self.pos[row] = 0


def token_slots(blocks: list[int], start: int, stop: int, block_tokens: int) -> list[int]:
    return [blocks[p // block_tokens] * block_tokens + p % block_tokens
            for p in range(start, stop)]


def decode_splits(rows: int, kv_heads: int, sms: int) -> int:
    """The most programs the decode kernel may give one row's tokens (its grid has rows x
    kv_heads x this many; a row takes fewer when it is short, see decode_kernel.split_size):
    enough for one long row among `rows` to spread over the whole GPU, at most 64."""
    if not sms:
        return 1
    return max(1, min(64, -(-8 * sms // (rows * kv_heads))))
