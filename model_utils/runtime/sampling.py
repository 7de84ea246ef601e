"""One token from one row of logits: repetition penalty, temperature, top-k, top-p, a draw.

Shared by the single-stream loop (generation.decode_tokens) and the batch scheduler, which
samples each row with that row's own settings. Nothing here waits for the device, so a batch can
feed its next step with tokens the host has not read yet.

Non-finite logits (a model that overflowed to inf or NaN, or a score pushed past float32 by the
penalty or a small temperature) are not detected with an `if` on the host, which would stop the
device: the logits are kept finite instead (NaN scores lowest, +-inf becomes the largest float).
The softmax of a finite vector is finite, and its largest entry is 1 before normalising, so the
probabilities handed to torch.multinomial are always valid, whatever the settings did.
"""

from __future__ import annotations

import math

import torch

# Below GREEDY_TEMPERATURE (declared with the settings) a temperature is greedy: dividing
# float32 logits by 2.28e-39 gives inf, and then NaN probabilities. At 1e-5 a logit gap of
# 0.001 is already e^100 apart, i.e. argmax anyway.
from .generation_settings import GREEDY_TEMPERATURE

FLOAT32_MAX = torch.finfo(torch.float32).max


def is_greedy(settings) -> bool:
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


def sample_token(logits: torch.Tensor, settings, seen: torch.Tensor,
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


def sample_next(logits: torch.Tensor, settings, seen: torch.Tensor,
                generator: torch.Generator | None) -> int:
    """sample_token, read on the host."""
    return int(sample_token(logits, settings, seen, generator))
