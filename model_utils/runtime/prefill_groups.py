"""Which admitted prompts are prefilled together, and how: a policy on lengths, no tensors.

Every prompt that fits the padded prefill (a CUDA graph per rows x prompt-length bucket, see
prefill.py) goes through it, those arriving together in groups of up to 8 that one replay can
take: a chat arriving while others decode costs them a few milliseconds, and no prompt meets a
shape seen for the first time. Every other prompt (a long one, one whose start is cached
already, any prompt on the CPU) is prefilled by itself, in chunks if it is long (runner.py):
it is computing, not launching, that takes its time.

Why not one eager forward for a group of the others, which is one pass over the weights: on
the H200 groups of 7-15 prompts prefilled that way waited 0.7-1.8 s for their first token
(benchmarks/HISTORY.md; the cause is not pinned down: a shape not seen before, or hundreds of Python
launches beside the web server's threads), where a replay has neither: 8 prompts arriving at
once had their first tokens after 45 ms (bf16 7B).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .requests import Request


def prefill_groups(requests: list[Request], *, fits: Callable[[Request], bool],
                   fit_together: Callable[[list[int]], bool]
                   ) -> Iterator[tuple[list[Request], bool]]:
    """(requests, padded): the groups admitted prompts are prefilled in. `fits(request)`: the
    padded prefill takes its prompt (never, without one); `fit_together(lengths)`: one replay
    takes prompts of these lengths."""
    fitting = [r for r in requests if fits(r)]
    group: list[Request] = []
    for request in fitting:
        lengths = [len(r.prompt_ids) for r in group + [request]]
        if group and not fit_together(lengths):
            yield group, True
            group = []
        group.append(request)
    if group:
        yield group, True
    for request in requests:
        if request not in fitting:
            yield [request], False
