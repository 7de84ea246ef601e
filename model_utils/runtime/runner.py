"""The batch runner: every forward pass, the KV cache, sampling on the device and readback.

It does what the scheduler (scheduler.py) decides and nothing else: prefill a group of prompts
(by the padded prefill's CUDA graphs where they fit, else in one eager forward of left-padded
prompts), give the first batch cache its size, sample first tokens, copy a prompt's KV into a
row, launch one decode step for the active rows (the eager forward, or cuda_graphs'
GraphedBatchStep), and move a row when another leaves. All on the engine's decode worker.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .decoders import input_device
from .kv_cache import BatchKV, bucket, kv_bytes_per_row
from .prefill import PaddedPrefill
from .readback import TokenReadback
from .sampling import RowSampler, sample_rows

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel
    from transformers.cache_utils import Cache

    from .cuda_graphs import GraphCapture
    from .requests import Request

log = logging.getLogger(__name__)

# Share of the memory free after loading that the batch KV cache may take (per device).
KV_MEMORY_SHARE = 0.5
# step_fn(kv, b, w) -> logits [b, V] of one decode step on the (b, w) view of the cache.
StepFn = Callable[[BatchKV, int, int], torch.Tensor]
# Rows whose sampling raised: (index in the step's rows, the error).
Failures = list[tuple[int, Exception]]


class EagerStep:
    """One decode step for rows [0, b) on the model's own forward: logits [b, V]."""

    name = "eager"

    def __init__(self, model: PreTrainedModel):
        self.model = model

    def __call__(self, kv: BatchKV, b: int, w: int) -> torch.Tensor:
        return self.model(**kv.inputs(b, w)).logits[:, -1]


@dataclass(eq=False)
class Prefilled:
    """Prompts after their forward: logits [n, V] of each one's last token, their KV in row i
    of `cache`, ending at slot ends[i] (None: at the cache's last slot, as left-padded)."""

    logits: torch.Tensor
    cache: Cache
    ends: list[int] | None = None


class BatchRunner:
    """Runs one loaded model's batched decoding: up to max_batch rows of context_tokens slots."""

    def __init__(self, model: PreTrainedModel, *, context_tokens: int, max_batch: int,
                 step_fn: StepFn | None = None):
        self.model = model
        self.context_tokens = context_tokens
        self.max_batch = max_batch
        # The eager forward, or cuda_graphs.GraphedBatchStep's captured graphs.
        self.step_fn: StepFn = step_fn or EagerStep(model)
        self.device = input_device(model)
        self.kv: BatchKV | None = None  # allocated at the first request (sized by its KV)
        self.padded_prefill: PaddedPrefill | None = None  # see use_padded_prefill
        self._readback: TokenReadback | None = None  # made with the cache
        self._samplers: dict[Request, RowSampler] = {}  # requests set up and not ended

    # -- at load time (on the worker thread, no loop running) ----------------------------------
    def warm_up(self, row_counts: Iterable[int] = (1,)) -> None:
        """Compile and capture the step for the row buckets of `row_counts` ahead of any reply,
        so that a new batch size does not stall the replies decoding. Call on the worker
        thread (engine.worker.call), where no loop is running: it uses the cache's rows."""
        with torch.inference_mode():
            if self.kv is None:
                _, cache = self.forward_prompts([[0] * 16])
                self.kv = self._allocate(cache)
                # The first masked forward of several prompts (eager groups: the CPU, and
                # prompts longer than the prefill graphs) has first-call costs of its own.
                self.forward_prompts([[0] * 16, [0] * 12])
            kv = self.kv
            for b in sorted({bucket(min(r, kv.rows), kv.row_buckets) for r in row_counts}):
                kv.relayout(0, 0)
                kv.prepare_step(b, 0)
                self.step_fn(kv, b, kv.windows[0])
            kv.relayout(0, 0)

    def use_padded_prefill(self, capture: GraphCapture | None = None) -> float:
        """Prefill short prompts through prefill.PaddedPrefill (captured as CUDA graphs by
        `capture`, a cuda_graphs.GraphCapture; eager without), set up now; returns the seconds
        it took. On the worker thread, after warm_up (which allocates the cache)."""
        padded = PaddedPrefill(self.model, self.kv, capture=capture)
        if not padded.buckets:  # a context shorter than the smallest bucket
            return 0.0
        with torch.inference_mode():
            seconds = padded.warm_up()
        self.padded_prefill = padded
        return seconds

    def cache_bytes(self) -> int:
        """Bytes of the caches replies decode in: the batch cache and the prefill row."""
        return (self.kv.nbytes if self.kv else 0) + \
            (self.padded_prefill.nbytes if self.padded_prefill else 0)

    # -- what the scheduler asks for -----------------------------------------------------------
    @property
    def capacity(self) -> int | None:
        """Rows of the batch cache; None until the first prompt sizes it."""
        return self.kv.rows if self.kv else None

    def session(self) -> contextlib.AbstractContextManager:
        """The context the scheduler's loop runs in."""
        return torch.inference_mode()

    def fits_padded(self, tokens: int) -> bool:
        return self.padded_prefill is not None and self.padded_prefill.fits(tokens)

    def fit_padded_together(self, lengths: list[int]) -> bool:
        return self.padded_prefill is not None and self.padded_prefill.fit_together(lengths)

    def set_up(self, request: Request) -> None:
        """A request's own sampling state on the device; raises for settings it cannot take."""
        self._samplers[request] = RowSampler.set_up(request.settings, request.input_ids,
                                                    request.eos_ids, self.device,
                                                    request.logprobs)

    def release(self, request: Request) -> None:
        """Forget a request's device state (it ended, or is set up afresh)."""
        self._samplers.pop(request, None)

    def prefill(self, requests: list[Request], padded: bool) -> Prefilled:
        """One forward of the requests' prompts: the padded prefill (right-padded, a graph
        replay on a GPU), or eager (left-padded; one prompt alone is exactly the forward of a
        single reply)."""
        prompts = [r.input_ids for r in requests]
        if padded:
            logits, cache, ends = self.padded_prefill(prompts)
            return Prefilled(logits, cache, ends)
        logits, cache = self.forward_prompts(prompts)
        return Prefilled(logits, cache)

    def forward_prompts(self, prompts: list[list[int]]) -> tuple[torch.Tensor, DynamicCache]:
        """(logits [n, V] of each prompt's last token, a DynamicCache of their KV): one eager
        forward, the prompts left-padded to the longest, masked when there are several."""
        from transformers import DynamicCache

        lengths = [len(p) for p in prompts]
        width = max(lengths)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        positions = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, (prompt, length) in enumerate(zip(prompts, lengths)):
            ids[i, width - length:] = torch.tensor(prompt)
            positions[i, width - length:] = torch.arange(length)
            mask[i, width - length:] = 1
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids.to(self.device), position_ids=positions.to(self.device),
                         attention_mask=mask.to(self.device) if len(prompts) > 1 else None,
                         cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1], cache

    def allocate(self, prefilled: Prefilled) -> int:
        """The batch cache, made at the first prompt (sized by its KV); returns its rows."""
        if self.kv is None:
            self.kv = self._allocate(prefilled.cache)
        return self.kv.rows

    def first_tokens(self, prefilled: Prefilled,
                     requests: list[Request]) -> tuple[list[int], Failures]:
        """Sample the first token of each of `requests` (prefilled[i] for requests[i])."""
        tokens, failures = self._sample(prefilled.logits[:len(requests)], requests)
        return tokens.tolist(), failures

    def place(self, row: int, prefilled: Prefilled, source: int, length: int,
              token: int) -> None:
        """Prompt `source` of `prefilled` (its `length` tokens) into cache row `row`, the next
        free one, with `token` as its next input."""
        self.kv.place(row, prefilled.cache, length, row, source=source,
                      end=prefilled.ends[source] if prefilled.ends else None)
        self.kv.set_token(row, token)

    def launch(self, rows: list[Request],
               longest: int) -> tuple[Callable[[], list[int]], Failures]:
        """Queue one step for rows [0, len(rows)) and the sampling of its tokens; nothing waits
        for the device. The tokens become the next step's inputs on the device; the returned
        function reads them on the host (waiting for the step if it still runs). `longest`:
        the most tokens any row holds."""
        kv = self.kv
        b, w = kv.prepare_step(len(rows), longest)
        logits = self.step_fn(kv, b, w)  # [b, V]
        kv.advance(b)
        tokens, failures = self._sample(logits[:len(rows)], rows)
        kv.ids[:len(rows), 0].copy_(tokens)
        return self._readback.start(tokens), failures

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.kv.move_row(src, dst, length)

    # -- inside ---------------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor,
                requests: list[Request]) -> tuple[torch.Tensor, Failures]:
        # A request that ended is released (no sampler): its row's token is void.
        return sample_rows(logits, [self._samplers.get(r) for r in requests],
                           hold_eos=[r.sampled < r.settings.min_new_tokens for r in requests])

    def _allocate(self, prompt_cache: Cache) -> BatchKV:
        """The batch cache: max_batch rows of context_tokens slots, fewer if memory is short."""
        per_row = kv_bytes_per_row(prompt_cache, self.context_tokens)
        rows = self.max_batch
        for device, size in per_row.items():
            free = _free_bytes(device)
            rows = min(rows, max(1, int(free * KV_MEMORY_SHARE // size)))
        if rows < self.max_batch:
            log.warning("batch cache: memory for %d of %d rows of %d tokens", rows,
                        self.max_batch, self.context_tokens)
        log.info("batch cache: %d rows x %d tokens, %.3f GB", rows, self.context_tokens,
                 rows * sum(per_row.values()) / 2**30)
        self._readback = TokenReadback(self.device, rows)
        return BatchKV(self.model, prompt_cache, rows=rows, length=self.context_tokens,
                       device=self.device)


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    import psutil

    return psutil.virtual_memory().available
