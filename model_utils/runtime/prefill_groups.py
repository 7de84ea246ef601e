"""Which admitted prompts are prefilled together, and how: a policy on lengths, no tensors.

Every prompt that fits the padded prefill (a CUDA graph per rows x prompt-length bucket, see
prefill.py) goes through it, those arriving together in groups of up to 8 that one replay can
take: a chat arriving while others decode costs them a few milliseconds, and no prompt meets a
shape seen for the first time. The others share eager forwards (eager_chunks), which is also
the whole story on the CPU.

Why not one eager forward for a group, which is one pass over the weights: on the H200 groups
of 7-15 prompts prefilled that way waited 0.7-1.8 s for their first token (BENCHMARKS.md, runs
G-J; the cause is not pinned down: a shape not seen before, or hundreds of Python launches
beside the web server's threads), where a replay has neither: 8 prompts arriving at once had
their first tokens after 45 ms (bf16 7B, run M).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .requests import Request

# Most (padded) prompt tokens prefilled in one eager forward: bounds its activation memory.
PREFILL_TOKENS = 8192


def prefill_groups(requests: list[Request], *, fits: Callable[[int], bool],
                   fit_together: Callable[[list[int]], bool]
                   ) -> Iterator[tuple[list[Request], bool]]:
    """(requests, padded): the groups admitted prompts are prefilled in. `fits(tokens)`: the
    padded prefill takes a prompt that long (never, without one); `fit_together(lengths)`: one
    replay takes prompts of these lengths."""
    fitting = [r for r in requests if fits(len(r.input_ids))]
    group: list[Request] = []
    for request in fitting:
        lengths = [len(r.input_ids) for r in group + [request]]
        if group and not fit_together(lengths):
            yield group, True
            group = []
        group.append(request)
    if group:
        yield group, True
    rest = [r for r in requests if r not in fitting]
    for chunk in eager_chunks(rest):
        yield chunk, False


def eager_chunks(requests: list[Request]) -> Iterator[list[Request]]:
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
