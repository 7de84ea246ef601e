"""Streaming generation: the decode loop and per-reply stats (the settings: generation_settings).

The loop is gpt-fast's pipeline: prefill -> decode_one_token -> ... with a check of the stop
signal between steps, so Stop takes effect within one decode step. Which cache and which compiled
step it runs on is the Decoder's business (decoders.py); this module does not care.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import tokenizers
import torch
from tokenizers.decoders import DecodeStream

from .generation_settings import BY_NAME as _SETTING
from .generation_settings import GenerationSettings

if TYPE_CHECKING:
    from .decoders import EagerDecoder
    from .grammar import Constraint

from .grammar import mask_logits
from .reply_stats import ReplyStats
from .sampling import (
    is_greedy,
    sample_next,
    suppress,
)

MAX_TEMPERATURE = _SETTING["temperature"].high
REPETITION_PENALTY_RANGE = (_SETTING["repetition_penalty"].low, _SETTING["repetition_penalty"].high)
MAX_TOP_K = _SETTING["top_k"].high


# -- streaming text -----------------------------------------------------------------------------
class IncrementalDetokenizer:
    """Token ids in, new text out (a delta per token, often ""), never splitting a multi-byte
    character; skipped special tokens add nothing. Joined, the pieces (with flush()'s) are
    tokenizer.decode(ids, skip_special_tokens=True).

    A fast tokenizer runs tokenizers' DecodeStream on its Rust backend. Others (a slow
    tokenizer, or one whose decode cleans up spaces, which DecodeStream does not do) decode a
    short window: the tokens since the last piece plus the ones before it, for context (a
    sentencepiece tokenizer drops the leading space of a window's first token, so the new text
    is the window's decode minus its context's). Either way a step costs the window, not the
    reply: `decoded_tokens` counts the token ids the window decodes handled (the test's probe).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # the window: ids[_prefix:_read] is context, ids[_read:] is new
        self._read = 0
        self.decoded_tokens = 0
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = None
        if isinstance(backend, tokenizers.Tokenizer) and \
                not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self._backend = backend
            self._stream = DecodeStream(skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self._stream is not None:
            try:
                piece = self._stream.step(self._backend, token_id)
            except Exception:  # noqa: BLE001 - its prefix check failed: go on by window
                self._stream = None
                return self._window()
            if piece is not None:
                self._prefix, self._read = self._read, len(self.ids)
            return piece or ""
        return self._window()

    def flush(self) -> str:
        """What the last tokens decode to when they never completed a character (a reply cut
        mid-emoji ends in U+FFFD, as tokenizer.decode of the whole reply does)."""
        if self._read == len(self.ids):
            return ""
        before, now = self._decode_window()
        self._prefix = self._read = len(self.ids)
        return now[len(before):]

    def _decode_window(self) -> tuple[str, str]:
        decode = self.tokenizer.decode
        self.decoded_tokens += (self._read - self._prefix) + (len(self.ids) - self._prefix)
        return (decode(self.ids[self._prefix:self._read], skip_special_tokens=True),
                decode(self.ids[self._prefix:], skip_special_tokens=True))

    def _window(self) -> str:
        before, now = self._decode_window()
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return now[len(before):]
        return ""


# -- the loop -----------------------------------------------------------------------------------
def decode_tokens(decoder: EagerDecoder, input_ids: list[int], settings: GenerationSettings, *,
                  eos_ids: set[int], stop: threading.Event | None = None,
                  stats: ReplyStats | None = None,
                  constraint: Constraint | None = None,
                  record: LogprobRecord | None = None) -> Iterator[int]:
    """Yield new token ids until EOS, max_new_tokens, or the stop signal; with a
    `constraint` (grammar.py), only tokens that keep the reply in its format; with a
    `record`, each token's log-probabilities kept there.

    `decoder` owns the model and the cache: prefill(ids) -> logits[V], step(token) -> logits[V].
    """
    stats = stats if stats is not None else ReplyStats()
    stop = stop or threading.Event()
    generator = None
    if settings.seed is not None and not is_greedy(settings):
        generator = torch.Generator(device=decoder.sample_device).manual_seed(settings.seed)
    seen = torch.tensor(input_ids, dtype=torch.long, device=decoder.sample_device)
    stats.prompt_tokens = len(input_ids)
    stats.decode_path = decoder.name
    start = time.perf_counter()
    first = start
    logits = decoder.prefill(input_ids, max_new_tokens=settings.max_new_tokens)
    finish = "length"
    for n in range(settings.max_new_tokens):
        if stop.is_set():
            finish = "stop"
            break
        if n < settings.min_new_tokens and eos_ids:
            logits = suppress(logits, eos_ids)
        if constraint is not None:
            logits = mask_logits(logits[None], [constraint])[0]
        token = sample_next(logits, settings, seen, generator)
        if record is not None:
            record.add(logits, token)
        now = time.perf_counter()
        if n == 0:
            first = now
            stats.ttft_ms = (now - start) * 1000
        stats.new_tokens = n + 1
        if n:
            stats.tok_s = n / (now - first)
        stats.total_s = now - start
        if token in eos_ids:
            stats.new_tokens = n  # EOS is not part of the reply
            finish = "eos"
            break
        if constraint is not None:
            constraint.accept(token)
        yield token
        if settings.repetition_penalty != 1.0:
            seen = torch.cat([seen, seen.new_tensor([token])])
        if n + 1 < settings.max_new_tokens and not stop.is_set():
            logits = decoder.step(token)
    stats.finish_reason = finish
    stats.stopped = finish == "stop"
    stats.total_s = time.perf_counter() - start


class LogprobRecord:
    """Each sampled token's log-probability and its `k` likeliest alternatives, kept on the
    device as they are sampled (the batch runner appends to `top` and `chosen` itself, the
    single-stream decoder through add) and read on the host one token at a time."""

    def __init__(self, k: int):
        self.k = max(1, k)
        self.top: list = []  # torch.topk results, one per sampled token
        self.chosen: list = []  # (log-probability, id) of each drawn token, 0-d tensors

    def add(self, logits: torch.Tensor, token: int) -> None:
        logp = torch.log_softmax(logits.float(), -1)
        self.top.append(logp.topk(self.k))
        self.chosen.append((logp[token], torch.tensor(token)))

    def __len__(self) -> int:
        return len(self.chosen)

    def drawn(self, i: int) -> int:
        """The i-th sampled token's id (an EOS too, which the reply's tokens leave out)."""
        return int(self.chosen[i][1])

    def entry(self, i: int) -> tuple[float, list[tuple[int, float]]]:
        """(the i-th token's log-probability, [(alternative id, its log-probability), ...])."""
        values, ids = self.top[i]
        return float(self.chosen[i][0]), list(zip(ids.tolist(), values.tolist()))
