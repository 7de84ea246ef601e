"""The KV cache that concurrent replies share: one row per reply, one write index for all.

Layout. Each layer keeps K and V as [rows, kv_heads, length, head_dim]. Every active row ends at
the same slot j, the shared write index: a reply whose cache holds L tokens occupies slots
[j - L, j) of its row, and one decode step writes slot j of every row, then j += 1. A [rows,
length] boolean mask says which slots each row attends to, and positions are per row. Keys are
stored after the rotary embedding, so a reply's tokens may sit at any slots: only the mask and
the position of its next token must be its own.

Why one shared index: transformers' StaticLayer writes at its `cumulative_length`, a device
tensor, so a decode step of fixed shapes writes the next slot by itself and a CUDA graph can
replay it; a reply joins or leaves without the others waiting for it.

Keeping it compact. When j reaches the end, or the replies left are much shorter than j (long
ones finished), `relayout` shifts all rows left so that they end at the longest one's length; a
new reply whose prompt is longer than j shifts them right. Either is one slice copy per layer.
Active replies live in rows [0, n) (one that leaves is replaced by the last), and the forward
runs on a view of the first b rows and w slots, b and w from short bucket lists: the cost
follows the load and the lengths rather than the allocation, and each (b, w) is one fixed
shape for a compiled step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .attention import NAME as PACKED_SDPA

# The slot windows a decode step runs on (the cache's first `w` slots): each is one fixed shape
# for a captured step, so a reply growing past one moves to the next instead of a new shape.
CACHE_BUCKETS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.cache_utils import Cache

# The attention_mask argument of a forward: one mask, or one per layer type (sliding windows).
MaskArg = torch.Tensor | dict[str, torch.Tensor]
SUPPORTED_LAYERS = {"full_attention", "sliding_attention"}
# Attention implementations whose mask we can build ourselves: sdpa takes a boolean mask (True =
# attend), eager an additive float one. Others (flash, flex) want their own formats.
MASK_KINDS = {"sdpa": "bool", PACKED_SDPA: "bool", "eager": "float"}


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
    types = set(layer_types(model))
    if not types <= SUPPORTED_LAYERS:
        return False, f"layer types {sorted(types - SUPPORTED_LAYERS)} are not batched"
    attention = model.config._attn_implementation
    if attention not in MASK_KINDS:
        return False, f"attention implementation {attention!r} is not batched"
    return True, ""


def kv_bytes_per_row(prompt_cache: Cache, length: int) -> dict[torch.device, int]:
    """Bytes one row of `length` slots takes on each device, from a prefilled batch-1 cache."""
    per_device: dict[torch.device, int] = {}
    for layer in prompt_cache.layers:
        for tensor in (layer.keys, layer.values):
            size = tensor.shape[1] * tensor.shape[3] * tensor.element_size() * length
            per_device[tensor.device] = per_device.get(tensor.device, 0) + size
    return per_device


def static_cache(keys: list[torch.Tensor], values: list[torch.Tensor],
                 indices: list[torch.Tensor]) -> Cache:
    """A transformers Cache whose StaticLayers use the given storage ([b, kv_heads, w, d] per
    layer, views allowed) and write at the given device indices (their cumulative_length)."""
    from transformers.cache_utils import Cache, StaticLayer

    layers = []
    for k, v, index in zip(keys, values, indices):
        layer = StaticLayer(max_cache_len=k.shape[2])
        layer.keys, layer.values = k, v
        layer.cumulative_length = index
        layer.device = k.device
        layer.batch_size, layer.num_heads = k.shape[0], k.shape[1]
        layer.k_head_dim, layer.v_head_dim = k.shape[3], v.shape[3]
        layer.is_initialized = True
        layers.append(layer)
    return Cache(layers=layers)


class BatchKV:
    """K/V storage, masks, positions and input ids for up to `rows` replies of `length` slots."""

    def __init__(self, model: PreTrainedModel, prompt_cache: Cache, *, rows: int, length: int,
                 device: torch.device):
        self.rows, self.length, self.device = rows, length, device
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.index: list[torch.Tensor] = []  # each layer's cumulative_length: its write slot
        for layer in prompt_cache.layers:
            k, v = layer.keys, layer.values  # [1, kv_heads, prompt, head_dim]
            self.keys.append(k.new_zeros(rows, k.shape[1], length, k.shape[3]))
            self.values.append(v.new_zeros(rows, v.shape[1], length, v.shape[3]))
            self.index.append(torch.zeros((), dtype=torch.long, device=k.device))
        self.j = 0
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.mask = torch.zeros(rows, length, dtype=torch.bool, device=device)
        self.windows = tuple(w for w in CACHE_BUCKETS if w < length) + (length,)
        self.row_buckets = tuple(b for b in ROW_BUCKETS if b < rows) + (rows,)
        self._masks = _ModelMasks(model, self.mask)
        self._views: dict[tuple[int, int], Cache] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of the K/V storage."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    # -- what a forward pass reads ---------------------------------------------------------
    def view(self, b: int, w: int) -> Cache:
        """A transformers Cache over rows [0, b) and slots [0, w), sharing this storage."""
        key = (b, w)
        if key not in self._views:
            self._views[key] = static_cache([k[:b, :, :w] for k in self.keys],
                                            [v[:b, :, :w] for v in self.values], self.index)
        return self._views[key]

    def inputs(self, b: int, w: int) -> dict[str, Any]:
        """Keyword arguments of the model's forward for one decode step on the (b, w) view.
        The tensors are views of persistent buffers, so a captured graph reads them in place."""
        return dict(input_ids=self.ids[:b], position_ids=self.pos[:b],
                    attention_mask=self._masks.arg(b, w), cache=self.view(b, w),
                    use_cache=True, logits_to_keep=1)

    # -- bookkeeping between steps ----------------------------------------------------------
    def place(self, row: int, prompt_cache: Cache, prompt_len: int, active: int, *,
              source: int = 0, end: int | None = None) -> None:
        """Copy a prefilled prompt into `row`, ending at the write index: the prompt_len slots
        of row `source` of prompt_cache that end at slot `end` (default: its last slot, as
        prompts prefilled together are left-padded; a padded prefill's prompt ends earlier).
        `active` rows [0, active) hold replies already; `row` is the next free."""
        if active == 0:
            self._set_index(prompt_len)  # nobody to move: a new epoch
        elif prompt_len > self.j:
            self.relayout(prompt_len, active)
        start = self.j - prompt_len
        for layer, k, v in zip(prompt_cache.layers, self.keys, self.values):
            stop = layer.keys.shape[2] if end is None else end
            k[row, :, start:self.j] = layer.keys[source, :, stop - prompt_len:stop]
            v[row, :, start:self.j] = layer.values[source, :, stop - prompt_len:stop]
        self.mask[row] = False
        self.mask[row, start:self.j] = True
        self.pos[row, 0] = prompt_len

    def relayout(self, new_j: int, active: int) -> None:
        """Move rows [0, active) so that they end at slot new_j (>= the longest's length)."""
        span = min(self.j, new_j)  # what can hold live tokens of some row
        if active and span and new_j != self.j:
            old, new = slice(self.j - span, self.j), slice(new_j - span, new_j)
            for store in (*self.keys, *self.values):
                store[:active, :, new] = store[:active, :, old].clone()  # ranges may overlap
            self.mask[:active, new] = self.mask[:active, old].clone()
        self.mask[:active, :new_j - span] = False
        self.mask[:active, new_j:] = False
        self._set_index(new_j)

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Row src (holding `length` tokens) takes row dst's place."""
        start = self.j - length
        for store in (*self.keys, *self.values):
            store[dst, :, start:self.j] = store[src, :, start:self.j]
        self.mask[dst] = self.mask[src]
        self.pos[dst] = self.pos[src]
        self.ids[dst] = self.ids[src]

    def set_token(self, row: int, token: int) -> None:
        """The next input of `row` (a new reply's first token). Later inputs are written on the
        device by the step that samples them (see runner.BatchRunner.launch)."""
        self.ids[row, 0] = token

    def prepare_step(self, active: int, longest: int) -> tuple[int, int]:
        """Set up one decode step for rows [0, active), whose input tokens are in `ids`, writing
        at slot j. `longest`: the most tokens any active row holds. Returns the view (b, w) to
        run. Nothing here waits for the device."""
        if self.j + 1 > self.length or \
                bucket(self.j + 1, self.windows) > bucket(longest + 1, self.windows):
            self.relayout(longest, active)
        b, w = bucket(active, self.row_buckets), bucket(self.j + 1, self.windows)
        self.mask[:b, self.j] = True  # padding rows attend to their own slot: no empty softmax
        self._masks.refresh(b, w, self.j)
        return b, w

    def advance(self, b: int) -> None:
        """After a step: the model advanced every layer's index; mirror it, move positions on."""
        self.j += 1
        self.pos[:b] += 1

    def set_index_after_capture(self) -> None:
        """Graph capture runs the step a few times; put the write index back."""
        self._set_index(self.j)

    def _set_index(self, j: int) -> None:
        self.j = j
        for index in self.index:
            index.fill_(j)


class _ModelMasks:
    """The mask argument of the model's forward, built from the boolean [rows, length] mask.

    A 4D mask is taken by transformers as is ([b, 1, 1, w] broadcasts over heads and the one
    query). sdpa reads the boolean mask itself; eager attention needs an additive float copy;
    sliding-window layers get their own mask keyed by layer type (rows are contiguous, so "the
    last `window` slots" is "the last `window` positions").
    """

    def __init__(self, model: PreTrainedModel, mask: torch.Tensor):
        self.mask = mask
        kind = MASK_KINDS[model.config._attn_implementation]
        self.dtype = model.dtype
        self.float = torch.zeros(mask.shape, dtype=self.dtype, device=mask.device) \
            if kind == "float" else None
        config = model.config.get_text_config(decoder=True)
        self.window = getattr(config, "sliding_window", None) \
            if "sliding_attention" in layer_types(model) else None
        self.sliding = torch.zeros_like(mask) if self.window else None
        self.sliding_float = torch.zeros_like(self.float) \
            if self.window and self.float is not None else None
        self.slots = torch.arange(mask.shape[1], device=mask.device)
        self._args: dict[tuple[int, int], MaskArg] = {}

    def refresh(self, b: int, w: int, j: int) -> None:
        if self.sliding is not None:
            torch.logical_and(self.mask[:b, :w], self.slots[:w] > j - self.window,
                              out=self.sliding[:b, :w])
        if self.float is not None:
            low = torch.finfo(self.dtype).min
            self.float[:b, :w] = torch.where(self.mask[:b, :w], 0.0, low)
            if self.sliding_float is not None:
                self.sliding_float[:b, :w] = torch.where(self.sliding[:b, :w], 0.0, low)

    def arg(self, b: int, w: int) -> MaskArg:
        key = (b, w)
        if key not in self._args:
            full = self.float if self.float is not None else self.mask
            arg = full[:b, None, None, :w]
            if self.sliding is not None:
                sliding = self.sliding_float if self.sliding_float is not None else self.sliding
                arg = {"full_attention": arg, "sliding_attention": sliding[:b, None, None, :w]}
            self._args[key] = arg
        return self._args[key]
