"""What the batch scheduler asks of the runner that owns the tensors, and the limits both keep."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

from model_utils.engine_config import MAX_BATCH_LIMIT

if TYPE_CHECKING:
    from .kv_blocks import BlockPool, PrefixMatch
    from .requests import Request
    from .runner import Prefilled

# Rows whose sampling raised: (index in the step's rows, the error).
Failures = list[tuple[int, Exception]]


class Runner(Protocol):
    """What the scheduler asks of the runner (runner.BatchRunner, where each is described;
    the unit tests drive the scheduler with a plain-Python one). `Prefilled` is the runner's
    own record of a prefill, handed back to it as is."""

    @property
    def capacity(self) -> int: ...  # rows: replies that decode at once
    def blocks(self) -> BlockPool: ...  # the KV cache's blocks (allocated at the first call)
    def reusable_blocks(self, match: PrefixMatch) -> int: ...  # matched blocks to start after
    min_reuse_tokens: int  # ... covering at least this many tokens
    def session(self) -> AbstractContextManager: ...  # the context the whole loop runs in
    def fits_padded(self, tokens: int) -> bool: ...  # the padded prefill takes this prompt
    def fit_padded_together(self, lengths: list[int]) -> bool: ...  # ... these in one replay
    def set_up(self, request: Request) -> None: ...  # its sampling state; may raise
    def is_set_up(self, request: Request) -> bool: ...
    def release(self, request: Request) -> None: ...  # forget that state
    def prefill(self, requests: list[Request], padded: bool) -> Prefilled: ...
    def first_tokens(self, prefilled: Prefilled,
                     requests: list[Request]) -> tuple[list[int], Failures]: ...
    def place(self, row: int, request: Request, token: int) -> None: ...  # `token` next
    def add_blocks(self, entries: list[tuple[int, int, int]]) -> None: ...
    def launch(self, rows: list[Request],
               longest: int) -> tuple[Callable[[], list[int]], Failures]: ...  # one step
    def move_row(self, src: int, dst: int) -> None: ...
    def clear_row(self, row: int) -> None: ...


def check_limits(max_batch: int, max_queue: int) -> None:
    if not isinstance(max_batch, int) or not 1 <= max_batch <= MAX_BATCH_LIMIT:
        raise ValueError(f"max_batch must be between 1 and {MAX_BATCH_LIMIT}, got {max_batch}")
    if not isinstance(max_queue, int) or max_queue < 0:
        raise ValueError(f"max_queue must be >= 0, got {max_queue}")
