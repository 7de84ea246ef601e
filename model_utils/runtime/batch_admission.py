"""Admitting waiting requests to the batch: prefilling their prompts and giving them rows.

The half of batching.BatchScheduler that runs between decode steps (see its docstring for the
loop): free rows go to waiting requests, whose prompts are prefilled together (by the padded
prefill's CUDA graphs where they fit, else in eager forwards of left-padded prompts), each
first token is sampled, and each prompt's KV is copied into its row. A group whose prefill
fails is prefilled again request by request, so that a request that cannot be prefilled ends
by itself and the others of its group go on.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from .sampling import is_greedy

if TYPE_CHECKING:
    from .batching import Request

log = logging.getLogger(__name__)

# Most (padded) prompt tokens prefilled in one forward: bounds its activation memory.
PREFILL_TOKENS = 8192


class Admission:
    """Mixed into BatchScheduler, whose state (rows, kv, _waiting, _lock, padded_prefill ...)
    and decode-side methods (_allocate, _sample, _accept, _finish) it uses."""

    def _admit(self) -> None:
        """Give free rows to waiting requests; their prompts are prefilled together."""
        capacity = self.kv.rows if self.kv else self.max_batch
        group: list[Request] = []
        with self._lock:
            while self._waiting and len(self.rows) + len(group) < capacity:
                group.append(self._waiting.popleft())
                self._admitted += 1
        starting = []
        for request in group:  # one look at each stop event: every request goes one way
            if request.stop.is_set():
                self._finish(request, "stop")
            else:
                starting.append(request)
        for chunk, padded in self._prefill_groups(starting):
            self._prefill_isolated(chunk, padded)

    def _prefill_isolated(self, requests: list[Request], padded: bool) -> None:
        """Prefill a group; if that fails, prefill each of its requests alone, so that a
        request that cannot be prefilled (whatever the cause) ends by itself and the others
        of its group go on."""
        try:
            self._prefill(requests, padded)
            return
        except Exception as group_error:  # noqa: BLE001 - sorted out below, one by one
            error = group_error
            if len(requests) == 1:
                self._fail_unplaced(requests, error)
                return
            log.warning("prefill of %d prompts together failed (%s): each alone now",
                        len(requests), error)
        for request in self._unplaced(requests):
            if request.new_tokens:  # its first token is out already: a retry would repeat it
                self._fail_unplaced([request], error)
                continue
            request.sampled, request.seen, request.generator = 0, None, None
            try:
                self._prefill([request], padded)
            except Exception as alone:  # noqa: BLE001 - this request fails, the others go on
                self._fail_unplaced([request], alone)

    def _unplaced(self, requests: list[Request]) -> list[Request]:
        """Those of `requests` not placed in a row, not ended and not sent back to wait."""
        with self._lock:
            requeued = set(self._waiting)
        return [r for r in requests if r not in self.rows and not r.stats.finish_reason
                and r not in requeued]

    def _fail_unplaced(self, requests: list[Request], error: Exception) -> None:
        log.error("prefill failed: %s", error, exc_info=error)
        for request in self._unplaced(requests):
            self._finish(request, "error", error)

    def _prefill_groups(self, requests: list[Request]) -> Iterator[tuple[list[Request], bool]]:
        """(requests, padded): how admitted prompts are prefilled.

        Every prompt that fits the padded prefill (a CUDA graph per rows x prompt-length bucket,
        see prefill.py) goes through it, those arriving together in groups of up to 8 that one
        replay can take: a chat arriving while others decode costs them a few milliseconds, and
        no prompt meets a shape seen for the first time. The others share eager forwards
        (_prefill_chunks), which is also the whole story on the CPU.
        Why not one eager forward for a group, which is one pass over the weights: on the H200
        groups of 7-15 prompts prefilled that way waited 0.7-1.8 s for their first token
        (BENCHMARKS.md, runs G-J; the cause is not pinned down: a shape not seen before, or
        hundreds of Python launches beside the web server's threads), where a replay has
        neither: 8 prompts arriving at once had their first tokens after 45 ms (bf16 7B, run M).
        """
        padded = self.padded_prefill
        if padded:
            fitting = [r for r in requests if padded.fits(len(r.input_ids))]
            group: list[Request] = []
            for request in fitting:
                lengths = [len(r.input_ids) for r in group + [request]]
                if group and not padded.fit_together(lengths):
                    yield group, True
                    group = []
                group.append(request)
            if group:
                yield group, True
            requests = [r for r in requests if r not in fitting]
        for chunk in _prefill_chunks(requests):
            yield chunk, False

    def _prefill(self, requests: list[Request], padded: bool = False) -> None:
        """Prefill prompts, sample each one's first token, and copy each one's KV into a free
        row of the batch cache. Prompts prefilled together eagerly are left-padded (one alone is
        exactly the forward of a single reply); the padded prefill right-pads them.
        A request whose own setup fails (its seed, say) ends here, before the forward."""
        ready = []
        for request in requests:
            try:
                self._set_up(request)
            except Exception as error:  # noqa: BLE001 - this request fails, the others go on
                self._fail_unplaced([request], error)
            else:
                ready.append(request)
        requests = ready
        if not requests:
            return
        if padded:
            logits, cache, ends = self.padded_prefill([r.input_ids for r in requests])
            self._start(requests, logits, cache, ends=ends)
            return
        logits, cache = self._forward_prompts([r.input_ids for r in requests])
        self._start(requests, logits, cache)

    def _set_up(self, request: Request) -> None:
        """A request's own sampling state on the device: its generator, seen ids, EOS ids."""
        settings = request.settings
        if settings.seed is not None and not is_greedy(settings):
            request.generator = torch.Generator(device=self.device).manual_seed(settings.seed)
        if settings.repetition_penalty != 1.0:
            request.seen = torch.tensor(request.input_ids, dtype=torch.long, device=self.device)
        if settings.min_new_tokens and request.eos_ids:
            request.eos = torch.tensor(sorted(request.eos_ids), device=self.device)

    def _forward_prompts(self, prompts: list[list[int]]):
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

    def _start(self, requests: list[Request], logits: torch.Tensor, cache, *,
               ends: list[int] | None = None) -> None:
        """Sample the first tokens of prefilled requests (logits [n, V], prompt KV in row i of
        `cache`, ending at slot ends[i], default its last) and give each a row. Memory may give
        the cache fewer rows than max_batch: the surplus waits again."""
        if self.kv is None:
            self.kv = self._allocate(cache)
        keep = self.kv.rows - len(self.rows)
        if keep < len(requests):
            self._wait_again(requests[keep:])
            requests = requests[:keep]
        tokens = self._sample(logits[:len(requests)], requests).tolist()
        for i, (request, token) in enumerate(zip(requests, tokens)):
            if request.finished or not self._accept(request, token):  # (failed sampling)
                continue
            request.length = len(request.input_ids)
            row = len(self.rows)
            self.kv.place(row, cache, request.length, row, source=i,
                          end=ends[i] if ends else None)
            self.kv.set_token(row, token)
            self.rows.append(request)
        self.peak_rows = max(self.peak_rows, len(self.rows))

    def _wait_again(self, requests: list[Request]) -> None:
        """Put admitted requests back at the head of the queue, in order."""
        if requests:
            with self._lock:
                self._waiting.extendleft(reversed(requests))
                self._admitted -= len(requests)


def _prefill_chunks(requests: list[Request]) -> Iterator[list[Request]]:
    """Groups of requests prefilled in one forward: at most PREFILL_TOKENS padded tokens."""
    chunk: list[Request] = []
    for request in sorted(requests, key=lambda r: len(r.input_ids)):
        width = len(request.input_ids)  # the longest so far, as the list is sorted
        if chunk and (len(chunk) + 1) * width > PREFILL_TOKENS:
            yield chunk
            chunk = []
        chunk.append(request)
    if chunk:
        yield chunk
