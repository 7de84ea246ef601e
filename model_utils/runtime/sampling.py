"""The one sampler: repetition penalty, temperature, top-k, top-p, a draw; for one row of
logits (sample_token) and for a batch whose rows each have their own settings (sample_rows).

Used by the single-stream loop (generation.decode_tokens) and the batch runner alike. Nothing
here waits for the device, so a batch can feed its next step with tokens the host has not read
yet.

Non-finite logits (a model that overflowed to inf or NaN, or a score pushed past float32 by the
penalty or a small temperature) are not detected with an `if` on the host, which would stop the
device: the logits are kept finite instead (NaN scores lowest, +-inf becomes the largest float).
The softmax of a finite vector is finite, and its largest entry is 1 before normalising, so the
probabilities handed to torch.multinomial are always valid, whatever the settings did.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from model_utils.runtime.generation_settings import GenerationSettings

# Below GREEDY_TEMPERATURE (declared with the settings) a temperature is greedy: dividing
# float32 logits by 2.28e-39 gives inf, and then NaN probabilities. At 1e-5 a logit gap of
# 0.001 is already e^100 apart, i.e. argmax anyway.
from .generation_settings import GREEDY_TEMPERATURE

FLOAT32_MAX = torch.finfo(torch.float32).max
LOGPROBS_K = 5  # top-k kept per token for a request that records logprobs
TopK = torch.return_types.topk  # (values, indices) of torch.topk


def is_greedy(settings: GenerationSettings) -> bool:
    return settings.temperature < GREEDY_TEMPERATURE


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float):
    # logits: [V] float32; seen: [n] ids already in prompt or reply (CTRL paper's penalty,
    # as transformers applies it: divide positive scores, multiply negative ones).
    scores = logits.gather(0, seen)
    scores = torch.where(scores < 0, scores * penalty, scores / penalty)
    return logits.scatter(0, seen, scores)


def finite_logits(logits: torch.Tensor) -> torch.Tensor:
    """float32 logits with NaN as the lowest score and +-inf as the largest/lowest finite float:
    argmax of the result is always a real token, and its softmax never NaN."""
    return logits.float().nan_to_num(nan=-FLOAT32_MAX)


def sample_token(logits: torch.Tensor, settings: GenerationSettings, seen: torch.Tensor,
                 generator: torch.Generator | None) -> torch.Tensor:
    """logits [V] -> the next token id as a 0-d tensor on logits' device, in transformers'
    order: penalty, temperature, top-k, top-p. A temperature below GREEDY_TEMPERATURE is greedy
    (argmax), which is what the equality tests compare."""
    logits = finite_logits(logits)
    if settings.repetition_penalty != 1.0 and seen.numel():
        logits = apply_repetition_penalty(logits, seen, settings.repetition_penalty)
        logits = logits.nan_to_num_()  # a score the penalty pushed past float32: finite again
    if is_greedy(settings):
        return logits.argmax()
    logits = (logits / settings.temperature).nan_to_num_()  # likewise for a small temperature
    if settings.top_k:
        kth = torch.topk(logits, min(settings.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if settings.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop tokens once the mass before them already reaches top_p; the first always stays
        # (also when top_p is so small that float32 rounds it to 0).
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= settings.top_p
        drop[0] = False
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, -math.inf))
    # Finite logits, at least one unmasked (top-k keeps the k-th, top-p the first): valid.
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[0]


def sample_next(logits: torch.Tensor, settings: GenerationSettings, seen: torch.Tensor,
                generator: torch.Generator | None) -> int:
    """sample_token, read on the host."""
    return int(sample_token(logits, settings, seen, generator))


def suppress(logits: torch.Tensor, token_ids: Iterable[int]) -> torch.Tensor:
    """A copy of logits [V] where `token_ids` cannot be drawn (min_new_tokens holds back EOS)."""
    logits = logits.clone()
    logits[list(token_ids)] = -math.inf
    return logits


@dataclass(eq=False)
class RowSampler:
    """One batched reply's sampling state on the device: its generator (a seeded reply), the
    ids it has seen (for the repetition penalty), its EOS ids (held back by min_new_tokens)."""

    settings: GenerationSettings
    generator: torch.Generator | None = None
    seen: torch.Tensor | None = None  # prompt + reply ids
    eos: torch.Tensor | None = None
    # When a list, each sampled token appends the top `logprob_k` (log-probabilities, token
    # ids) of its logits, on the device (bench/logprob_check.py, the API's top_logprobs); and
    # when `chosen` is a list too, (the log-probability of the token drawn, its id), 0-d tensors
    # on the device.
    logprobs: list[TopK] | None = None
    logprob_k: int = LOGPROBS_K
    chosen: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @classmethod
    def set_up(cls, settings: GenerationSettings, input_ids: list[int], eos_ids: set[int],
               device: torch.device, logprobs: list[TopK] | None = None, *,
               logprob_k: int = LOGPROBS_K,
               chosen: list | None = None) -> RowSampler:
        """Raises for settings torch cannot take (a seed past 64 bits, say): that request
        fails alone."""
        sampler = cls(settings, logprobs=logprobs, logprob_k=logprob_k, chosen=chosen)
        if settings.seed is not None and not is_greedy(settings):
            sampler.generator = torch.Generator(device=device).manual_seed(settings.seed)
        if settings.repetition_penalty != 1.0:
            sampler.seen = torch.tensor(input_ids, dtype=torch.long, device=device)
        if settings.min_new_tokens and eos_ids:
            sampler.eos = torch.tensor(sorted(eos_ids), device=device)
        return sampler

    @property
    def greedy(self) -> bool:
        return is_greedy(self.settings) and self.settings.repetition_penalty == 1.0


def sample_rows(logits: torch.Tensor, rows: list[RowSampler | None], *,
                hold_eos: list[bool]) -> tuple[torch.Tensor, list[tuple[int, Exception]]]:
    """logits [n, V] -> (one token per row on the device, [(row, error)] for rows whose
    sampling raised), each row with its own settings. rows[i] None: a row that ended in an
    earlier step still being read (its token is void); `hold_eos[i]`: row i has fewer than
    min_new_tokens tokens, so its EOS ids cannot be drawn.

    Greedy rows (the common case for benchmarks, and what the equality tests compare) are one
    argmax for all of them; others go through sample_token, the same function a single reply
    uses. The repetition penalty's record of seen tokens grows here, on the device. A row whose
    sampling raises keeps the greedy token in its slot so the step's tensors stay whole; the
    caller ends that row alone.
    """
    drawn_from = {}  # row -> its log-probabilities, for the drawn token's
    for i, row in enumerate(rows):
        if row is not None and row.logprobs is not None:
            logp = torch.log_softmax(logits[i].float(), -1)
            row.logprobs.append(logp.topk(row.logprob_k))
            if row.chosen is not None:
                drawn_from[i] = logp
    masked = [i for i, row in enumerate(rows)
              if hold_eos[i] and row is not None and row.eos is not None]
    if masked:
        logits = logits.float()
        for i in masked:
            logits[i].index_fill_(0, rows[i].eos, -math.inf)
    # A NaN row's argmax is still some token id: nothing to guard for the greedy rows (and
    # no extra pass over [rows, vocabulary] each step); sample_token guards its own.
    tokens = logits.argmax(-1)
    failures: list[tuple[int, Exception]] = []
    for i, row in enumerate(rows):
        if row is None:
            continue
        try:
            if not row.greedy:
                seen = row.seen if row.seen is not None else tokens.new_empty(0)
                tokens[i] = sample_token(logits[i], row.settings, seen, row.generator)
            if row.seen is not None:
                row.seen = torch.cat([row.seen, tokens[i:i + 1]])
        except Exception as error:  # noqa: BLE001 - this row fails, the others go on
            failures.append((i, error))
    for i, logp in drawn_from.items():
        rows[i].chosen.append((logp[tokens[i]], tokens[i].clone()))
    return tokens, failures
