"""A prompt's forward pass with fixed shapes, so that a CUDA graph can replay it.

On a GPU a chat-sized prompt is launch-bound: 128 tokens through a 7B model are about 2 TFLOP, a
few milliseconds of H200 work, but the eager forward launches several hundred kernels from
Python one by one (24-42 ms measured for that prompt, BENCHMARKS.md run E). While it runs, every
reply already decoding waits. Here the prompt is right-padded to a bucket length and written
into a preallocated one-row cache; ids, positions, the causal mask, the cache and the index of
the logits to keep are persistent buffers, so each bucket's forward is captured once (at load)
and every prompt of that size is one graph replay.

Why right padding: the causal mask stays the same for every prompt (no prompt token can see the
padding after it), positions are simply 0..n-1, and the prompt's KV sits in slots [0, n) of the
cache, from where batch_cache.BatchKV.place copies it into a reply's row. Only the logits of the
prompt's last token are computed (logits_to_keep as a device index).
"""

from __future__ import annotations

import logging
import time

import torch

from .batch_cache import MASK_KINDS, BatchKV, bucket, layer_types, static_cache

log = logging.getLogger(__name__)

# Prompt lengths with a graph of their own; a longer prompt is prefilled eagerly (it is less
# launch-bound, and each bucket keeps its activations' memory in the graph pool).
PREFILL_BUCKETS = (64, 128, 256, 512, 1024)


def support(model) -> tuple[bool, str]:
    """(applies, why not): models whose layers all attend to the full context; sliding-window
    layers would need masks of their own."""
    types = set(layer_types(model))
    if types != {"full_attention"}:
        return False, f"layer types {sorted(types)}"
    return True, ""


class PaddedPrefill:
    """Prefill one prompt of up to the largest bucket's tokens: (logits [1, V], cache, n) where
    the cache holds the prompt's KV in slots [0, n) of its only row.

    `capture`: replay each bucket as a CUDA graph (on a CUDA device); without it the same padded
    forward runs eagerly, which is what the CPU tests compare with an unpadded prefill.
    """

    def __init__(self, model, kv: BatchKV, *, capture: bool,
                 buckets: tuple[int, ...] = PREFILL_BUCKETS, pool=None):
        self.model = model
        self.kv = kv
        self.capture = capture
        self.buckets = tuple(b for b in buckets if b <= kv.length)
        self.mask_kind = MASK_KINDS[model.config._attn_implementation]
        # One row of the largest bucket's slots, per layer; each bucket's cache is a view of it.
        slots = self.buckets[-1] if self.buckets else 0
        self.keys = [k.new_zeros(1, k.shape[1], slots, k.shape[3]) for k in kv.keys]
        self.values = [v.new_zeros(1, v.shape[1], slots, v.shape[3]) for v in kv.values]
        self.indices = [torch.zeros((), dtype=torch.long, device=k.device) for k in kv.keys]
        self._entries: dict[int, _Bucket] = {}
        self.pool = pool  # CUDA-graph memory pool (fast_path.shared_pool), or one of its own
        self.uncaptured: list[int] = []  # buckets whose capture failed: they run eagerly

    @property
    def nbytes(self) -> int:
        """Bytes of the one-row cache the prompts are prefilled into."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def fits(self, tokens: int) -> bool:
        return bool(self.buckets) and tokens <= self.buckets[-1]

    def __call__(self, input_ids: list[int]):
        n = len(input_ids)
        entry = self._entry(bucket(n, self.buckets))
        entry.ids[0, :n].copy_(torch.tensor(input_ids), non_blocking=True)
        entry.last.fill_(n - 1)
        return entry.run()[:, -1], entry.cache, n

    def warm_up(self) -> float:
        """Capture every bucket now (load time), so that no reply waits for it."""
        start = time.perf_counter()
        for size in self.buckets:
            self._entry(size)
        return time.perf_counter() - start

    def _entry(self, size: int) -> _Bucket:
        entry = self._entries.get(size)
        if entry is None:
            entry = _Bucket(self, size)
            if self.capture:
                self._capture(entry)
            self._entries[size] = entry
        return entry

    def _capture(self, entry: _Bucket) -> None:
        from .fast_path import capture_graph

        start = time.perf_counter()
        try:
            graph, logits = capture_graph(entry.forward, lambda: None, self.pool)
        except Exception:  # noqa: BLE001 - this bucket's prompts are prefilled uncaptured
            log.exception("capturing the prefill of %d tokens failed", entry.size)
            self.uncaptured.append(entry.size)
            return
        self.pool = graph.pool()

        def replay():
            graph.replay()
            return logits

        entry.run = replay
        log.info("captured the prefill of up to %d tokens in %.2f s", entry.size,
                 time.perf_counter() - start)


class _Bucket:
    """The persistent inputs and the one-row cache of one prompt length."""

    def __init__(self, owner: PaddedPrefill, size: int):
        self.model, self.size = owner.model, size
        device, dtype = owner.kv.device, owner.model.dtype
        self.ids = torch.zeros(1, size, dtype=torch.long, device=device)
        self.positions = torch.arange(size, device=device)[None]
        self.last = torch.zeros(1, dtype=torch.long, device=device)  # the logits to keep
        causal = torch.ones(size, size, dtype=torch.bool, device=device).tril()
        if owner.mask_kind == "float":  # eager attention adds its mask
            causal = torch.zeros(causal.shape, dtype=dtype, device=device).masked_fill(
                ~causal, torch.finfo(dtype).min)
        self.mask = causal[None, None]
        self.indices = owner.indices
        self.cache = static_cache([k[:, :, :size] for k in owner.keys],
                                  [v[:, :, :size] for v in owner.values], self.indices)
        self.run = self.forward

    def forward(self) -> torch.Tensor:
        for index in self.indices:  # each prompt is written from slot 0
            index.zero_()
        return self.model(input_ids=self.ids, position_ids=self.positions,
                           attention_mask=self.mask, cache=self.cache, use_cache=True,
                           logits_to_keep=self.last).logits
