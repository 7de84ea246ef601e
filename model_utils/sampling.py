"""One token from one row of logits: repetition penalty, temperature, top-k, top-p, a draw.

Shared by the single-stream loop (generation.decode_tokens) and the batch scheduler, which
samples each row with that row's own settings. Nothing here waits for the device, so a batch can
feed its next step with tokens the host has not read yet; that is also why a row whose
probabilities are not usable (logits that overflowed to inf or NaN) is not detected with an
`if` on the host but replaced on the device by its greedy token: no error, no sync, and the
other rows of the batch never see it.
"""

from __future__ import annotations

import math

import torch

# Below this a temperature is greedy: dividing float32 logits by 2.28e-39 gives inf, and then
# NaN probabilities. At 1e-5 a logit gap of 0.001 is already e^100 apart, i.e. argmax anyway.
GREEDY_TEMPERATURE = 1e-5


def is_greedy(settings) -> bool:
    return settings.temperature < GREEDY_TEMPERATURE


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float):
    # logits: [V] float32; seen: [n] ids already in prompt or reply (CTRL paper's penalty,
    # as transformers applies it: divide positive scores, multiply negative ones).
    scores = logits.gather(0, seen)
    scores = torch.where(scores < 0, scores * penalty, scores / penalty)
    return logits.scatter(0, seen, scores)


def finite_logits(logits: torch.Tensor) -> torch.Tensor:
    """NaN as the lowest score, +-inf as the largest/lowest finite float32: argmax of the result
    is always a real token, and softmax of it never produces NaN."""
    return logits.float().nan_to_num(nan=-torch.finfo(torch.float32).max)


def sample_token(logits: torch.Tensor, settings, seen: torch.Tensor,
                 generator: torch.Generator | None) -> torch.Tensor:
    """logits [V] -> the next token id as a 0-d tensor on logits' device, in transformers'
    order: penalty, temperature, top-k, top-p. A temperature below GREEDY_TEMPERATURE is greedy
    (argmax), which is what the equality tests compare."""
    logits = finite_logits(logits)
    if settings.repetition_penalty != 1.0 and seen.numel():
        logits = apply_repetition_penalty(logits, seen, settings.repetition_penalty)
    greedy = logits.argmax()
    if is_greedy(settings):
        return greedy
    logits = logits / settings.temperature
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
    probs = logits.softmax(-1)
    # Usable probabilities: finite, none negative, some mass. Otherwise this row is greedy.
    usable = torch.isfinite(probs).all() & (probs.sum() > 0)
    fallback = torch.zeros_like(probs).index_fill_(0, greedy.view(1), 1.0)
    probs = torch.where(usable, probs.nan_to_num(0.0, 0.0, 0.0).clamp_min(0.0), fallback)
    return torch.multinomial(probs, 1, generator=generator)[0]


def sample_next(logits: torch.Tensor, settings, seen: torch.Tensor,
                generator: torch.Generator | None) -> int:
    """sample_token, read on the host."""
    return int(sample_token(logits, settings, seen, generator))
