"""The batch runner: every forward pass, the paged KV cache, sampling on the device and readback.

It does what the scheduler (scheduler.py) decides and nothing else: prefill a group of prompts
into the blocks the scheduler gave them (by the padded prefill's CUDA graphs where they fit,
else one prompt at a time, in chunks, after the part of it the cache already holds), sample
first tokens, give a reply a row, write a row's new block into the table, launch one decode
step for the active rows (the eager forward, or cuda_graphs' GraphedBatchStep), and move a row
when another leaves. All on the engine's decode worker.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .decoders import input_device
from .grammar import mask_logits
from .kv_blocks import BlockPool, PrefixMatch, blocks_for, prefix_key
from .kv_cache import BLOCK_TOKENS, PagedKV, bucket, probe_layers
from .left_padded_prefill import LeftPaddedPrefill
from .linear_states import LinearStates, linear_layers
from .prefill import PREFILL_ROWS, PaddedPrefill
from .readback import TokenReadback
from .runner_protocol import Failures
from .sampling import RowSampler, sample_rows
from .state_snapshots import StateSnapshots, snapshot_count, snapshot_point
from .tail_rows import TAIL_ROWS, TailRows

if TYPE_CHECKING:
    from transformers import DynamicCache

    from .cuda_graphs import GraphCapture
    from .requests import Request

log = logging.getLogger(__name__)

# Share of the memory free after loading that the KV cache may take (per device).
KV_MEMORY_SHARE = 0.5
# A prompt longer than this is prefilled in chunks of it: bounds the forward's activations.
PREFILL_CHUNK = 8192
# A cached prefix shorter than this is computed again with the rest of the prompt: it saves
# little, and a prompt computed whole gets the same rounding whatever was asked before it (in
# bf16 a prefix read back and one computed afresh can part a greedy reply at a near-tie).
MIN_REUSE_TOKENS = 256
# Prompt lengths prefilled once at load on a model with linear-attention layers: multiples of
# 16 and not, of one chunk of the layers' kernels (64 tokens) and of many.
LINEAR_WARM_UP_LENGTHS = (64, 72, 1000, 1024, 4096, 4104)
# step_fn(kv, b) -> logits [b, V] of one decode step for rows [0, b) of the cache.
StepFn = Callable[[PagedKV, int], torch.Tensor]


class EagerStep:
    """One decode step for rows [0, b) on the model's own forward: logits [b, V]."""

    name = "eager"

    def __init__(self, model):
        self.model = model

    def __call__(self, kv: PagedKV, b: int) -> torch.Tensor:
        kv.prepare_decode(b)
        return self.model(**kv.decode_args(b)).logits[:, -1]


@dataclass(eq=False)
class Prefilled:
    """Prompts after their forward: logits [n, V] of each one's last token (their keys and
    values are in their blocks)."""

    logits: torch.Tensor


class BatchRunner:
    """Runs one loaded model's batched decoding: up to max_batch rows, a paged KV cache sized
    for at least one reply of context_tokens."""

    def __init__(self, model, *, context_tokens: int, max_batch: int,
                 step_fn: StepFn | None = None, kv_tokens: int | None = None):
        self.model = model
        self.context_tokens = context_tokens
        self.max_batch = max_batch
        # The eager forward, or cuda_graphs.GraphedBatchStep's captured graphs.
        self.step_fn: StepFn = step_fn or EagerStep(model)
        self.device = input_device(model)
        self.kv_tokens = kv_tokens  # the pool's size in tokens; None: from free memory
        self.min_reuse_tokens = MIN_REUSE_TOKENS
        # Most new tokens after a cached start decoded as rows (TAIL_ROWS; 0: never)
        self.tail_rows = TAIL_ROWS if getattr(self.step_fn, "replays_graphs", False) else 0
        self._tail: TailRows | None = None  # made at the first need
        self.kv: PagedKV | None = None  # allocated on first use
        self.pool: BlockPool | None = None
        self.snapshots: StateSnapshots | None = None  # linear layers' states at prompt points
        # Every linear layer keeps its states mid-forward (layers/gated_delta.py), so a
        # prompt's snapshot needs no forward of its own.
        linear = linear_layers(model).values()
        self.keeps_mid_forward = bool(linear) and all(hasattr(m, "in_proj_sizes") for m in linear)
        self.padded_prefill: PaddedPrefill | None = None  # see use_padded_prefill
        self._readback: TokenReadback | None = None  # made with the cache
        self._samplers: dict[Request, RowSampler] = {}  # requests set up and not ended
        self._staged: dict[Request, int] = {}  # see prefill

    # -- at load time (on the worker thread, no loop running) ----------------------------------
    def warm_up(self, row_counts: Iterable[int] = (1,)) -> None:
        """Compile and capture the step for the row buckets of `row_counts` ahead of any reply,
        so that a new batch size does not stall the replies decoding. Call on the worker
        thread (engine.worker.call), where no loop is running: it uses the cache's rows, all
        pointing at the null block then."""
        with torch.inference_mode():
            kv = self._cache()
            for b in sorted({bucket(min(r, kv.rows), kv.row_buckets) for r in row_counts}):
                kv.pad_rows(0, b)
                kv.set_lengths(b, 1, b)
                self.step_fn(kv, b)
            kv.pad_rows(0, kv.rows)

    def use_padded_prefill(self, capture: GraphCapture | None = None,
                           largest_only: bool = False) -> float:
        """Prompts prefilled by PaddedPrefill (LeftPaddedPrefill with linear layers), shapes
        captured by `capture` now: all, or the pool's (pool_shape). Seconds; after warm_up."""
        kv = self._cache()
        seconds = 0.0
        if kv.states is not None:  # right padding would run into a linear layer's state
            seconds = self._warm_up_linear_prefill()
            padded = LeftPaddedPrefill(self.model, kv, capture=capture)
        else:
            padded = PaddedPrefill(self.model, kv, capture=capture)
        if not padded.buckets:  # a context shorter than the smallest bucket
            return seconds
        with torch.inference_mode():
            seconds += padded.warm_up([padded.pool_shape()] if largest_only else None)
        self.padded_prefill = padded
        return seconds

    def _warm_up_linear_prefill(self) -> float:
        """Prefill a prompt of each of LINEAR_WARM_UP_LENGTHS once, untimed, so that a user's
        first prompt of such a length does not wait for the linear-attention layers' Triton
        kernels to compile: Triton compiles a kernel again for an integer argument that is, or
        is not, a multiple of 16 (a model of Qwen3.5-9B's shape waited seconds for its first
        prompt of an odd length on the H200, BENCHMARKS.md). Returns the seconds it took."""
        if self.device.type != "cuda":  # the CPU runs the layers' torch code: nothing compiles
            return 0.0
        start = time.perf_counter()
        self.prefill_untimed(LINEAR_WARM_UP_LENGTHS)
        return time.perf_counter() - start

    def prefill_untimed(self, lengths: Iterable[int]) -> None:
        """A throwaway prompt of each of `lengths` (those the context and free blocks allow)
        through the one-by-one prefill; its blocks are free again after."""
        with torch.inference_mode():
            for length in lengths:
                blocks = (self.blocks().allocate(blocks_for(length, BLOCK_TOKENS))
                          if length <= self.context_tokens else None)
                if blocks is None:
                    continue
                try:
                    self.forward_prompt([0] * length, blocks, snapshot=False)
                finally:
                    self.pool.release(blocks)

    def cache_bytes(self) -> int:
        """Bytes of the KV cache replies decode in (and the linear layers' kept states)."""
        return (self.kv.nbytes if self.kv else 0) + (self.snapshots.nbytes if self.snapshots else 0)

    # -- what the scheduler asks for -----------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Rows: replies that can decode at once."""
        return self.max_batch

    def blocks(self) -> BlockPool:
        """The block pool the scheduler hands out (the cache is allocated at the first call)."""
        self._cache()
        return self.pool

    def reusable_blocks(self, match: PrefixMatch) -> int:
        """How many of a prompt's matched blocks it may start after: all of them, or with
        linear-attention layers as many as end where their states were kept (state_snapshots)."""
        if self._cache().states is None:
            return len(match.blocks)
        return next((n for n in range(len(match.keys), 0, -1)
                     if match.keys[n - 1] in self.snapshots), 0)

    def session(self) -> contextlib.AbstractContextManager:
        """The context the scheduler's loop runs in."""
        return torch.inference_mode()

    def fits_padded(self, tokens: int) -> bool:
        """Whether the padded prefill takes a prompt of `tokens` (not one whose linear-
        attention states are to be kept: see left_padded_prefill)."""
        if self.padded_prefill is None or not self.padded_prefill.fits(tokens):
            return False
        return self.kv.states is None or \
            snapshot_point(tokens, BLOCK_TOKENS) < self.min_reuse_tokens

    def fit_padded_together(self, lengths: list[int]) -> bool:
        return self.padded_prefill is not None and self.padded_prefill.fit_together(lengths)

    def set_up(self, request: Request) -> None:
        """A request's own sampling state on the device; raises for settings it cannot take."""
        self._samplers[request] = RowSampler.set_up(
            request.settings, request.input_ids, request.eos_ids, self.device,
            request.logprobs, logprob_k=request.logprob_k, chosen=request.chosen)

    def is_set_up(self, request: Request) -> bool:
        return request in self._samplers

    def release(self, request: Request) -> None:
        """Forget a request's device state (it ended, or is set up afresh)."""
        self._samplers.pop(request, None)

    def prefill(self, requests: list[Request], padded: bool) -> Prefilled:
        """The forward of each request's prompt tokens the cache does not hold yet, written to
        its blocks: the padded prefill (right-padded, a graph replay on a GPU) for several at
        once, or one by one (in chunks of PREFILL_CHUNK, each after the ones before)."""
        # the staging slot of each prompt's linear-attention states (the padded prefill's row)
        self._staged = {r: i for i, r in enumerate(requests)} if padded else {}
        if padded:
            return Prefilled(self.padded_prefill([r.prompt_ids for r in requests],
                                                 [r.blocks for r in requests]))
        return Prefilled(torch.cat([self.forward_prompt(r.prompt_ids, r.blocks, r.cached_tokens)
                                    for r in requests]))

    def forward_prompt(self, tokens: list[int], blocks: list[int], cached: int = 0,
                       chunk: int = PREFILL_CHUNK, *, snapshot: bool = True) -> torch.Tensor:
        """Logits [1, V] of the last of `tokens`, whose first `cached` are in `blocks` already;
        the rest are computed and written there, `chunk` tokens per forward. With linear-
        attention layers, their states start from the snapshot at `cached`, and (`snapshot`)
        are kept at the prompt's snapshot point for a later prompt to start from."""
        kv = self._cache()
        if 0 < cached and len(tokens) - cached <= self.tail_rows and kv.states is None:
            return self._tail_rows()(tokens, blocks, cached)
        first = cached
        point = 0
        if kv.states is not None:
            if cached and not self.snapshots.restore(self._name(tokens, cached),
                                                     kv.states.prefill_slot):
                # Dropped since admission (other prompts kept theirs): the prefix again for
                # its states, its keys and values (in its blocks already) written nowhere.
                first = 0
            point = snapshot_point(len(tokens), BLOCK_TOKENS) if snapshot else 0
            if point <= cached or point < self.min_reuse_tokens:
                point = 0  # else the states are kept there (by the forward that passes it)
        # Layers that cannot keep the states mid-forward: a forward ends at the point.
        cut = {point} if point and not self.keeps_mid_forward else set()
        bounds = set(range(first, len(tokens), chunk)) | {cached} | cut - {len(tokens)}
        bounds = sorted(b for b in bounds if b >= first)
        logits = None
        for start, stop in zip(bounds, bounds[1:] + [len(tokens)]):
            slots = kv.slots_of(blocks, start, stop) if start >= cached else \
                torch.zeros(stop - start, dtype=torch.long, device=self.device)
            if start == 0:
                step = kv.prefill_step(slots)
            else:
                step = kv.extend_step(slots, kv.slots_of(blocks, 0, stop), start)
            ids = torch.tensor([tokens[start:stop]], device=self.device)
            positions = torch.arange(start, stop, device=self.device)[None]
            view = kv.states.prefill_view(fresh=start == 0) if kv.states else None
            kept = self._name(tokens, point) if view is not None and start < point < stop else None
            if kept is not None:
                view.keep_at, view.keep_into = point - start, self.snapshots.target(kept)
            try:
                logits = self.model(input_ids=ids, position_ids=positions,
                                    attention_mask=kv.no_masks, paged=step, use_cache=False,
                                    logits_to_keep=1,
                                    **({"cache": view} if view else {})).logits[:, -1]
            except BaseException:
                if kept is not None:  # a later prompt would start from half-written states
                    self.snapshots.discard(kept)
                raise
            finally:
                if view is not None:
                    view.keep_at, view.keep_into = 0, None
            if stop == point:
                self.snapshots.save(self._name(tokens, point), kv.states.prefill_slot)
        return logits

    @staticmethod
    def _name(tokens: list[int], length: int) -> int:
        return prefix_key(tokens, BLOCK_TOKENS, length // BLOCK_TOKENS)

    def warm_up_tail(self) -> None:
        """Capture the step a next turn's short tail is decoded in (tail_rows.TailRows) now
        rather than at a conversation's first next turn. On the worker thread."""
        if self.tail_rows and self._cache().states is None:
            with torch.inference_mode():
                self._tail_rows().warm_up()

    def _tail_rows(self) -> TailRows:
        if self._tail is None:
            self._tail = TailRows(self._cache(), self.step_fn, self.tail_rows)
        return self._tail

    def first_tokens(self, prefilled: Prefilled,
                     requests: list[Request]) -> tuple[list[int], Failures]:
        """Sample the first token of each of `requests` (prefilled[i] for requests[i])."""
        tokens, failures = self._sample(prefilled.logits[:len(requests)], requests)
        return tokens.tolist(), failures

    def place(self, row: int, request: Request, token: int) -> None:
        """`request` (its request.length tokens in its blocks) takes row `row`, the next free
        one, with `token` as its next input."""
        self.kv.place(row, request.blocks, request.length, token, self._staged.pop(request, 0))

    def add_blocks(self, entries: list[tuple[int, int, int]]) -> None:
        """(row, index, block): a row's next token starts block `index` of its table."""
        self.kv.add_blocks(entries)

    def launch(self, rows: list[Request],
               longest: int) -> tuple[Callable[[], list[int]], Failures]:
        """Queue one step for rows [0, len(rows)) and the sampling of its tokens; nothing waits
        for the device. The tokens become the next step's inputs on the device; the returned
        function reads them on the host (waiting for the step if it still runs). `longest`:
        the most tokens any row holds."""
        kv = self.kv
        n = len(rows)
        b = bucket(n, kv.row_buckets)
        kv.pad_rows(n, b)
        kv.set_lengths(b, longest + 1, sum(r.length for r in rows) + b)
        logits = self.step_fn(kv, b)  # [b, V]
        kv.advance(b)
        tokens, failures = self._sample(logits[:n], rows)
        kv.ids[:n, 0].copy_(tokens)
        return self._readback.start(tokens), failures

    def move_row(self, src: int, dst: int) -> None:
        self.kv.move_row(src, dst)

    def clear_row(self, row: int) -> None:
        self.kv.clear_row(row)

    # -- inside ---------------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor,
                requests: list[Request]) -> tuple[torch.Tensor, Failures]:
        # A request that ended is released (no sampler): its row's token is void.
        logits = mask_logits(logits, [None if r.finished else r.constraint for r in requests])
        return sample_rows(logits, [self._samplers.get(r) for r in requests],
                           hold_eos=[r.sampled < r.settings.min_new_tokens for r in requests])

    def _cache(self) -> PagedKV:
        """The paged cache and its block pool, made at the first need: enough blocks for every
        row to hold a whole context and one reply more (room for reused prefixes), fewer where
        memory is short, never fewer than one whole context."""
        if self.kv is not None:
            return self.kv
        probe = self._probe()
        layers = probe_layers(probe)
        per_token = {}
        for layer in layers:
            if layer is not None:
                per_token[layer.device] = per_token.get(layer.device, 0) + layer.bytes_per_token
        wanted = (self.max_batch + 1) * self.context_tokens
        tokens = self.kv_tokens or wanted
        if self.kv_tokens is None:
            for device, size in per_token.items():
                tokens = min(tokens, int(_free_bytes(device) * KV_MEMORY_SHARE // size))
        one_reply = self.context_tokens + BLOCK_TOKENS
        if tokens < one_reply:
            log.warning("KV cache: memory for %d tokens, fewer than one reply of the whole "
                        "context (%d): taking that much anyway", tokens, self.context_tokens)
            tokens = one_reply
        blocks = blocks_for(tokens, BLOCK_TOKENS) + 1  # + the null block
        states = (LinearStates(probe, self.max_batch, staging=PREFILL_ROWS[-1])
                  if linear_layers(self.model) else None)
        self.kv = PagedKV(self.model, layers, num_blocks=blocks, block_tokens=BLOCK_TOKENS,
                          rows=self.max_batch, context_tokens=self.context_tokens,
                          device=self.device, states=states)
        if states is not None:  # after the pools: from the memory they leave
            self.snapshots = StateSnapshots(states, snapshot_count(
                self.max_batch, StateSnapshots.slot_bytes(states), _free_bytes(self.device)))
        self.pool = BlockPool(blocks, BLOCK_TOKENS)
        self._readback = TokenReadback(self.device, self.max_batch)
        log.info("KV cache: %d blocks of %d tokens (%d tokens, %.3f GB) for %d rows",
                 blocks - 1, BLOCK_TOKENS, (blocks - 1) * BLOCK_TOKENS,
                 self.kv.nbytes / 2**30, self.max_batch)
        return self.kv

    def _probe(self) -> DynamicCache:
        """A cache a short forward filled: each layer's K/V (or state) shape, dtype, device."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        with torch.inference_mode():
            ids = torch.zeros(1, 4, dtype=torch.long, device=self.device)
            self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        return cache


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    import psutil

    return psutil.virtual_memory().available
