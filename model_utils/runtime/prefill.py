"""A prompt's forward pass with fixed shapes, so that a CUDA graph can replay it.

On a GPU a chat-sized prompt is launch-bound: 128 tokens through a 7B model are about 2 TFLOP, a
few milliseconds of H200 work, but the eager forward launches several hundred kernels from
Python one by one (24-42 ms measured for that prompt, BENCHMARKS.md run E). While it runs, every
reply already decoding waits. Here the prompt is right-padded to a bucket length and written
into a preallocated one-row cache; ids, positions, the causal mask, the cache and the index of
the logits to keep are persistent buffers, so each bucket's forward is captured once (at load)
and every prompt of that size is one graph replay. Prompts arriving together share a replay: up to
8 rows, as long as rows x bucket stays within the largest bucket (8 prompts of 128 tokens, 4 of
256, ...), so the graphs need no more cache and no more activation memory than one long prompt,
and a burst of users pays one pass over the weights instead of one per prompt (which matters
most for 4-bit weights, dequantized by every multi-token forward).

Why right padding: the causal mask stays the same for every prompt (no prompt token can see the
padding after it), positions are simply 0..n-1, and the prompt's KV sits in slots [0, n) of the
cache, from where kv_cache.BatchKV.place copies it into a reply's row. Only the logits of the
prompt's last token are computed (logits_to_keep as a device index: with r rows that is r x r
positions, of which the diagonal is kept).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .kv_cache import MASK_KINDS, BatchKV, bucket, layer_types, static_cache

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.cache_utils import Cache

    from .cuda_graphs import GraphCapture

log = logging.getLogger(__name__)

# Prompt lengths with a graph of their own; a longer prompt is prefilled eagerly (it is less
# launch-bound, and each bucket keeps its activations' memory in the graph pool).
PREFILL_BUCKETS = (64, 128, 256, 512, 1024)
PREFILL_ROWS = (1, 2, 4, 8)  # prompts prefilled by one replay


def support(model: PreTrainedModel) -> tuple[bool, str]:
    """(applies, why not): models whose layers all attend to the full context; sliding-window
    layers would need masks of their own."""
    types = set(layer_types(model))
    if types != {"full_attention"}:
        return False, f"layer types {sorted(types)}"
    return True, ""


class PaddedPrefill:
    """Prefill prompts of up to the largest bucket's tokens, several at once when they fit
    together: (logits [n, V], cache, lengths) where row i of the cache holds prompt i's KV in
    slots [0, lengths[i]).

    `capture` (a cuda_graphs.GraphCapture, on a CUDA device): replay each shape as a CUDA graph;
    without it the same padded forward runs eagerly, which is what the CPU tests compare with an
    unpadded prefill.
    """

    def __init__(self, model: PreTrainedModel, kv: BatchKV, *,
                 capture: GraphCapture | None = None,
                 buckets: tuple[int, ...] = PREFILL_BUCKETS):
        self.model = model
        self.kv = kv
        self.capture = capture
        self.buckets = tuple(b for b in buckets if b <= kv.length)
        self.mask_kind = MASK_KINDS[model.config._attn_implementation]
        # The largest bucket's slots, per layer; each (rows, size) cache is a view of them.
        self.slots = self.buckets[-1] if self.buckets else 0
        self.keys = [k.new_zeros(1, k.shape[1], self.slots, k.shape[3]) for k in kv.keys]
        self.values = [v.new_zeros(1, v.shape[1], self.slots, v.shape[3]) for v in kv.values]
        self.indices = [torch.zeros((), dtype=torch.long, device=k.device) for k in kv.keys]
        self.shapes = [(rows, size) for size in self.buckets for rows in PREFILL_ROWS
                       if rows * size <= self.slots]
        self._entries: dict[tuple[int, int], _Bucket] = {}
        self.uncaptured: list[tuple[int, int]] = []  # (rows, size) that run eagerly

    @property
    def nbytes(self) -> int:
        """Bytes of the cache the prompts are prefilled into (the largest bucket's slots)."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def fits(self, tokens: int) -> bool:
        return bool(self.buckets) and tokens <= self.buckets[-1]

    def fit_together(self, lengths: list[int]) -> bool:
        """Whether prompts of these lengths can be prefilled by one replay."""
        return (0 < len(lengths) <= PREFILL_ROWS[-1] and self.fits(max(lengths))
                and self._shape(lengths) in self.shapes)

    def __call__(self, prompts: list[list[int]]) -> tuple[torch.Tensor, Cache, list[int]]:
        lengths = [len(p) for p in prompts]
        entry = self._entry(self._shape(lengths))
        ids = torch.zeros(len(prompts), entry.size, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, :len(prompt)] = torch.tensor(prompt)
        entry.ids[:len(prompts)].copy_(ids, non_blocking=True)
        entry.last[:len(prompts)].copy_(torch.tensor(lengths) - 1, non_blocking=True)
        return entry.run()[:len(prompts)], entry.cache, lengths

    def warm_up(self) -> float:
        """Capture every shape now (load time), so that no reply waits for it."""
        start = time.perf_counter()
        for shape in self.shapes:
            self._entry(shape)
        return time.perf_counter() - start

    def _shape(self, lengths: list[int]) -> tuple[int, int]:
        return bucket(len(lengths), PREFILL_ROWS), bucket(max(lengths), self.buckets)

    def _entry(self, shape: tuple[int, int]) -> _Bucket:
        entry = self._entries.get(shape)
        if entry is None:
            entry = _Bucket(self, *shape)
            if self.capture is not None:
                self._capture(entry)
            self._entries[shape] = entry
        return entry

    def _capture(self, entry: _Bucket) -> None:
        start = time.perf_counter()
        try:
            graph, logits = self.capture(entry.forward, lambda: None)
        except Exception:  # noqa: BLE001 - this bucket's prompts are prefilled uncaptured
            log.exception("capturing the prefill of %d x %d tokens failed", entry.rows,
                          entry.size)
            self.uncaptured.append((entry.rows, entry.size))
            return

        def replay() -> torch.Tensor:
            graph.replay()
            return logits

        entry.run = replay
        log.info("captured the prefill of %d x up to %d tokens in %.2f s", entry.rows,
                 entry.size, time.perf_counter() - start)


class _Bucket:
    """The persistent inputs and the cache of `rows` prompts of up to `size` tokens."""

    def __init__(self, owner: PaddedPrefill, rows: int, size: int):
        self.model, self.rows, self.size = owner.model, rows, size
        device, dtype = owner.kv.device, owner.model.dtype
        self.ids = torch.zeros(rows, size, dtype=torch.long, device=device)
        self.positions = torch.arange(size, device=device).repeat(rows, 1)
        self.last = torch.zeros(rows, dtype=torch.long, device=device)  # the logits to keep
        causal = torch.ones(size, size, dtype=torch.bool, device=device).tril()
        if owner.mask_kind == "float":  # eager attention adds its mask
            causal = torch.zeros(causal.shape, dtype=dtype, device=device).masked_fill(
                ~causal, torch.finfo(dtype).min)
        self.mask = causal.expand(rows, 1, size, size)  # the same for every row
        self.indices = owner.indices
        self.cache = static_cache([_rows_view(k, rows, size) for k in owner.keys],
                                  [_rows_view(v, rows, size) for v in owner.values],
                                  self.indices)
        self.run: Callable[[], torch.Tensor] = self.forward  # or its graph's replay

    def forward(self) -> torch.Tensor:
        """Logits [rows, V]: row i's at position last[i]."""
        for index in self.indices:  # each prompt is written from slot 0
            index.zero_()
        logits = self.model(input_ids=self.ids, position_ids=self.positions,
                            attention_mask=self.mask, cache=self.cache, use_cache=True,
                            logits_to_keep=self.last).logits  # [rows, rows, V]
        return logits.diagonal(dim1=0, dim2=1).T


def _rows_view(store: torch.Tensor, rows: int, size: int) -> torch.Tensor:
    """[rows, heads, size, dim] over the start of a [1, heads, slots, dim] store (rows * size
    <= slots): the shapes are replayed one at a time, so they may share the memory."""
    _, heads, _, dim = store.shape
    return store.view(-1)[:rows * heads * size * dim].view(rows, heads, size, dim)
