"""A prompt's forward pass with fixed shapes, so that a CUDA graph can replay it.

On a GPU a chat-sized prompt is launch-bound: 128 tokens through a 7B model are about 2 TFLOP, a
few milliseconds of H200 work, but the eager forward launches several hundred kernels from
Python one by one (24-42 ms measured for that prompt). While it runs, every reply already
decoding waits. Here the prompt is right-padded to a bucket length; ids, positions, the slots
its keys and values go to in the paged cache and the index of the logits to keep are
persistent buffers, so each bucket's forward is captured once (at load) and every prompt of
that size is one graph replay. Prompts arriving together share a replay: up to 8 rows, as long
as rows x bucket stays within the largest bucket (8 prompts of 128 tokens, 4 of 256, ...), so
the graphs need no more activation memory than one long prompt, and a burst of users pays one
pass over the weights instead of one per prompt (which matters most for 4-bit weights,
dequantized by every multi-token forward).

Why right padding: causal attention keeps every prompt token from seeing the padding after it,
positions are simply 0..n-1, and the padding's keys and values go to the null block. Only the
logits of the prompt's last token are computed (logits_to_keep as a device index: with r rows
that is r x r positions, of which the diagonal is kept).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .kv_blocks import NULL_BLOCK
from .kv_cache import PagedKV, bucket, token_slots

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .cuda_graphs import GraphCapture

log = logging.getLogger(__name__)

# Prompt lengths with a graph of their own; a longer prompt is prefilled eagerly (it is less
# launch-bound, and each bucket keeps its activations' memory in the graph pool).
PREFILL_BUCKETS = (64, 128, 256, 512, 1024)
PREFILL_ROWS = (1, 2, 4, 8)  # prompts prefilled by one replay


class PaddedPrefill:
    """Prefill prompts of up to the largest bucket's tokens into their blocks, several at once
    when they fit together: logits [n, V] of each one's last token. (left_padded_prefill is
    the same for models with linear-attention layers.)

    `capture` (a cuda_graphs.GraphCapture, on a CUDA device): replay each shape as a CUDA graph;
    without it the same padded forward runs eagerly, which is what the CPU tests compare with an
    unpadded prefill.
    """

    def __init__(self, model: PreTrainedModel, kv: PagedKV, *,
                 capture: GraphCapture | None = None,
                 buckets: tuple[int, ...] = PREFILL_BUCKETS):
        self.model = model
        self.kv = kv
        self.capture = capture
        self.buckets = tuple(b for b in buckets if b <= kv.width * kv.block_tokens)
        self.slots = self.buckets[-1] if self.buckets else 0
        self.shapes = [(rows, size) for size in self.buckets for rows in PREFILL_ROWS
                       if rows * size <= self.slots]
        self._entries: dict[tuple[int, int], PrefillBucket] = {}
        self.bucket_type = PrefillBucket
        self.uncaptured: list[tuple[int, int]] = []  # (rows, size) that run eagerly

    def fits(self, tokens: int) -> bool:
        return bool(self.buckets) and tokens <= self.buckets[-1]

    def fit_together(self, lengths: list[int]) -> bool:
        """Whether prompts of these lengths can be prefilled by one replay."""
        return (0 < len(lengths) <= PREFILL_ROWS[-1] and self.fits(max(lengths))
                and self._shape(lengths) in self.shapes)

    def __call__(self, prompts: list[list[int]], blocks: list[list[int]]) -> torch.Tensor:
        """Logits [n, V]; prompt i's keys and values are written to blocks[i]."""
        lengths = [len(p) for p in prompts]
        entry = self._entry(self._shape(lengths))
        ids = torch.zeros(entry.rows, entry.size, dtype=torch.long)
        slots = torch.full((entry.rows, entry.size), NULL_BLOCK * self.kv.block_tokens,
                           dtype=torch.long)
        for row, (prompt, held) in enumerate(zip(prompts, blocks)):
            ids[row, :len(prompt)] = torch.tensor(prompt)
            slots[row, :len(prompt)] = torch.tensor(
                token_slots(held, 0, len(prompt), self.kv.block_tokens))
        entry.ids.copy_(ids, non_blocking=True)
        entry.slots.copy_(slots.view(-1), non_blocking=True)
        entry.last[:len(prompts)].copy_(torch.tensor(lengths) - 1, non_blocking=True)
        return entry.run()[:len(prompts)]

    def warm_up(self, shapes: list[tuple[int, int]] | None = None) -> float:
        """Capture `shapes` (by default every shape) now, so that no reply waits for them;
        returns the seconds it took."""
        start = time.perf_counter()
        for shape in self.shapes if shapes is None else shapes:
            self._entry(shape)
        return time.perf_counter() - start

    def pool_shape(self) -> tuple[int, int]:
        """The shape captured first, at load: of the most tokens at once, whose activations are
        about the most the graphs' shared pool must hold, so that the shapes captured after it
        fit in what it left there; the one of a single prompt (a first reply's). Only one: the
        other shapes of as many tokens need about as much, and each capture is a whole prefill
        of them (1.4 s with tinygemm's int4 layers on the 7B shape, BENCHMARKS.md)."""
        most = max(rows * size for rows, size in self.shapes)
        return min((rows, size) for rows, size in self.shapes if rows * size == most)

    def pending(self) -> list[tuple[int, int]]:
        """The shapes not set up (captured) yet: one prompt before several, a first reply's
        shape being one prompt's."""
        return sorted((s for s in self.shapes if s not in self._entries),
                      key=lambda shape: (shape[0] > 1, shape))

    def capture_next(self) -> bool:
        """Set up (capture) the first pending shape; True while more are pending."""
        pending = self.pending()
        if pending:
            with torch.inference_mode():
                self._entry(pending[0])
        return len(pending) > 1

    def _shape(self, lengths: list[int]) -> tuple[int, int]:
        return bucket(len(lengths), PREFILL_ROWS), bucket(max(lengths), self.buckets)

    def _entry(self, shape: tuple[int, int]) -> PrefillBucket:
        entry = self._entries.get(shape)
        if entry is None:
            entry = self.bucket_type(self, *shape)
            if self.capture is not None:
                self._capture(entry)
            self._entries[shape] = entry
        return entry

    def _capture(self, entry: PrefillBucket) -> None:
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


class PrefillBucket:
    """The persistent inputs of `rows` prompts of up to `size` tokens (slots: all to the null
    block until a prompt is given, so the warm-up writes nowhere that matters)."""

    def __init__(self, owner: PaddedPrefill, rows: int, size: int):
        self.model, self.rows, self.size = owner.model, rows, size
        kv = owner.kv
        device = kv.device
        self.ids = torch.zeros(rows, size, dtype=torch.long, device=device)
        self.positions = torch.arange(size, device=device).repeat(rows, 1)
        self.slots = torch.full((rows * size,), NULL_BLOCK * kv.block_tokens, dtype=torch.long,
                                device=device)
        self.last = torch.zeros(rows, dtype=torch.long, device=device)  # the logits to keep
        self.step = kv.prefill_step(self.slots)
        self.no_masks = kv.no_masks
        self.run: Callable[[], torch.Tensor] = self.forward  # or its graph's replay

    def forward(self) -> torch.Tensor:
        """Logits [rows, V]: row i's at position last[i]."""
        logits = self.model(input_ids=self.ids, position_ids=self.positions,
                            attention_mask=self.no_masks, paged=self.step, use_cache=False,
                            logits_to_keep=self.last).logits  # [rows, rows, V]
        return logits.diagonal(dim1=0, dim2=1).T
