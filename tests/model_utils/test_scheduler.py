"""The batch scheduler's decisions, without a model: admission order, rows given and reused,
one request's stop or failure leaving the others alone, the queue's limits.

The scheduler drives a runner through a small interface (runner_protocol.Runner); here that runner
is plain Python: reply token n of a request is a number made from its prompt and n, and the
runner keeps the rows as the KV cache would (placed, moved into holes) and checks at every
step that row i holds the request the scheduler says it does. So a row mixed up, reused while
taken or lost shows as a wrong token or a failed check. The loop runs on the test's thread:
`post` only collects it.
"""

from __future__ import annotations

import contextlib
import threading

import pytest

from model_utils.engine_config import MAX_BATCH_LIMIT
from model_utils.errors import QueueFull
from model_utils.runtime.generation_settings import GenerationSettings
from model_utils.runtime.kv_blocks import BlockPool
from model_utils.runtime.reply_stats import ReplyStats
from model_utils.runtime.runner_protocol import check_limits
from model_utils.runtime.scheduler import Scheduler

pytestmark = pytest.mark.unit

EOS = -1


def reply_token(request, n: int) -> int:
    """Token n of a request's reply: EOS at the position its prompt's second id names."""
    first, eos_at = request.input_ids[0], request.input_ids[1]
    return EOS if n == eos_at else first * 1000 + n


def expected(first: int, count: int) -> list[int]:
    return [first * 1000 + n for n in range(count)]


class ListRunner:
    """A runner in plain Python (see the module docstring). `blocks`, `block_tokens`: the KV
    cache's size (default: plenty); `padded`: whether prompts fit the padded prefill;
    `on_step(step_number, rows)` runs before each step is sampled."""

    max_batch = 0  # the rows asked for, as the real runner is told
    min_reuse_tokens = 0

    def __init__(self, *, blocks: int = 1000, block_tokens: int = 2, padded: bool = False,
                 on_step=None):
        self.pool = BlockPool(blocks, block_tokens)
        self.block_tokens = block_tokens
        self.padded = padded
        self.slots: dict[int, object] = {}  # cache row -> the request whose KV it holds
        self.prefilled: list[list[int]] = []  # each prefill's prompts (their first ids)
        self.prefill_log: list[tuple[int, list[int], int]] = []  # (first, tokens, cached)
        self.steps: list[int] = []  # rows per decode step
        self.set_up_now: set = set()  # requests with device state (set up, not released)
        self.on_step = on_step
        self.bad_setup: set[int] = set()  # first prompt ids whose set_up raises
        self.bad_groups: set[int] = set()  # first prompt ids that fail any group's prefill
        self.bad_sampling: dict[int, int] = {}  # first prompt id -> the step its sampling fails

    @property
    def capacity(self) -> int:
        return self.max_batch

    def blocks(self) -> BlockPool:
        return self.pool

    def session(self):
        return contextlib.nullcontext()

    def reusable_blocks(self, match) -> int:
        return len(match.blocks)

    def fits_padded(self, tokens: int) -> bool:
        return self.padded

    def fit_padded_together(self, lengths: list[int]) -> bool:
        return self.padded

    def set_up(self, request) -> None:
        if request.input_ids[0] in self.bad_setup:
            raise ValueError("this request's seed cannot be used")
        self.set_up_now.add(request)

    def is_set_up(self, request) -> bool:
        return request in self.set_up_now

    def release(self, request) -> None:
        self.set_up_now.discard(request)

    def prefill(self, requests, padded: bool):
        firsts = [r.input_ids[0] for r in requests]
        if len(requests) > 1 and self.bad_groups & set(firsts):
            raise RuntimeError("the group's forward failed")
        for r in requests:
            tokens = r.prompt_ids
            assert len(r.blocks) == -(-len(tokens) // self.block_tokens)
            assert all(self.pool.refs(b) > 0 for b in r.blocks)
            assert r.cached_tokens % self.block_tokens == 0 and r.cached_tokens < len(tokens)
            assert not padded or r.cached_tokens == 0
            self.prefill_log.append((r.input_ids[0], list(tokens), r.cached_tokens))
        self.prefilled.append(firsts)
        return list(requests)

    def first_tokens(self, prefilled, requests):
        assert all(r in self.set_up_now for r in requests)
        return [reply_token(r, r.sampled) for r in requests], []

    def place(self, row: int, request, token: int) -> None:
        assert row not in self.slots, "a taken row given again"
        assert row < self.max_batch and request.length == len(request.prompt_ids)
        assert token == reply_token(request, request.sampled - 1)
        self.slots[row] = request

    def add_blocks(self, entries) -> None:
        for row, index, block in entries:
            request = self.slots[row]
            assert request.blocks[index] == block and self.pool.refs(block) == 1

    def launch(self, rows, longest: int):
        for i, request in enumerate(rows):
            assert self.slots[i] is request, f"row {i} holds another request"
            assert request in self.set_up_now
            # the block the step writes this row's next token into is there
            assert request.length // self.block_tokens < len(request.blocks)
        assert len(rows) <= self.max_batch and longest == max(r.length for r in rows)
        self.steps.append(len(rows))
        if self.on_step:
            self.on_step(len(self.steps), rows)
        failures = [(i, RuntimeError("sampling failed")) for i, r in enumerate(rows)
                    if self.bad_sampling.get(r.input_ids[0]) == len(self.steps)]
        tokens = [reply_token(r, r.sampled) for r in rows]
        return (lambda: tokens), failures

    def move_row(self, src: int, dst: int) -> None:
        self.slots[dst] = self.slots.pop(src)

    def clear_row(self, row: int) -> None:
        self.slots.pop(row)


class Harness:
    """A scheduler on a ListRunner; the posted loop runs when run() is called."""

    def __init__(self, runner: ListRunner | None = None, *, max_batch: int = 2,
                 max_queue: int = 8, context_tokens: int = 64):
        self.runner = runner or ListRunner()
        self.runner.max_batch = max_batch
        self.jobs: list = []
        self.scheduler = Scheduler(self.runner, post=self.jobs.append,
                                   context_tokens=context_tokens, max_batch=max_batch,
                                   max_queue=max_queue)

    def submit(self, first: int, new_tokens: int, *, eos_at: int = 10**6, stop=None):
        stats = ReplyStats()
        stream = self.scheduler.submit([first, eos_at, 7],
                                       GenerationSettings(max_new_tokens=new_tokens),
                                       eos_ids={EOS}, stop=stop or threading.Event(),
                                       stats=stats)
        return stream, stats

    def run(self) -> None:
        while self.jobs:
            self.jobs.pop(0)()


def test_requests_take_rows_in_the_order_they_came_and_each_gets_its_own_reply():
    h = Harness(max_batch=2)
    lengths = {1: 3, 2: 9, 3: 4, 4: 6, 5: 2}
    streams = {first: h.submit(first, n) for first, n in lengths.items()}
    assert len(h.jobs) == 1  # one loop for them all
    assert h.scheduler.load() == {"active": 0, "waiting": 5, "max_batch": 2, "max_queue": 8}
    h.run()
    prefilled = [first for group in h.runner.prefilled for first in group]
    assert prefilled == [1, 2, 3, 4, 5]  # first come, first served
    for first, (stream, stats) in streams.items():
        assert list(stream) == expected(first, lengths[first])
        assert stats.finish_reason == "length" and stats.new_tokens == lengths[first]
    assert max(h.runner.steps) == 2 == h.scheduler.peak_rows  # never more rows than the batch
    assert h.scheduler.load()["active"] == 0 and not h.jobs
    assert not h.runner.set_up_now  # every request's device state was let go


def test_a_freed_row_is_reused_and_the_last_row_moves_into_the_hole():
    h = Harness(max_batch=3)
    short, long_a, long_b, late = (h.submit(1, 2), h.submit(2, 12), h.submit(3, 12),
                                   h.submit(4, 5))
    h.run()
    # Row 0 (request 1) ended first: request 3 moved from row 2 into it, and request 4 took
    # the free row; the runner checked at every step that each row held its request.
    assert [list(s) for s, _ in (short, long_a, long_b, late)] == [
        expected(1, 2), expected(2, 12), expected(3, 12), expected(4, 5)]
    assert h.runner.prefilled == [[1], [2], [3], [4]]  # each alone: no padded prefill here
    assert h.scheduler.peak_rows == 3 and max(h.runner.steps) == 3


def test_eos_ends_a_reply_early_and_is_not_part_of_it():
    h = Harness()
    (ended, ended_stats), (other, other_stats) = h.submit(1, 20, eos_at=4), h.submit(2, 6)
    h.run()
    assert list(ended) == expected(1, 4) and ended_stats.finish_reason == "eos"
    assert list(other) == expected(2, 6) and other_stats.finish_reason == "length"


def test_stopping_one_reply_ends_it_alone():
    stop = threading.Event()

    def on_step(step, rows):
        if step == 3:
            stop.set()

    h = Harness(ListRunner(on_step=on_step), max_batch=3)
    first, stopped, third = h.submit(1, 10), h.submit(2, 50, stop=stop), h.submit(3, 10)
    h.run()
    assert stopped[1].finish_reason == "stop" and stopped[1].stopped
    assert 3 <= len(list(stopped[0])) <= 5  # within a step of the Stop (one may be in flight)
    for (stream, stats), n in ((first, 1), (third, 3)):
        assert list(stream) == expected(n, 10) and stats.finish_reason == "length"
    assert h.scheduler.load()["active"] == 0


def test_a_request_stopped_while_it_waits_is_never_prefilled():
    h = Harness(max_batch=1)
    stop = threading.Event()
    running, waiting = h.submit(1, 4), h.submit(2, 4, stop=stop)
    stop.set()
    h.run()
    assert list(waiting[0]) == [] and waiting[1].finish_reason == "stop"
    assert list(running[0]) == expected(1, 4)
    assert h.runner.prefilled == [[1]]


def test_a_full_queue_refuses_at_once_and_takes_requests_again_once_drained():
    h = Harness(max_batch=2, max_queue=1)
    streams = [h.submit(i, 3) for i in range(1, 4)]
    with pytest.raises(QueueFull, match="busy"):
        h.submit(9, 3)
    assert h.scheduler.load()["waiting"] == 3
    h.run()
    assert [list(s) for s, _ in streams] == [expected(i, 3) for i in range(1, 4)]
    again, _ = h.submit(9, 3)
    h.run()
    assert list(again) == expected(9, 3)


def test_limits_and_the_context_window_are_checked_before_anything_queues():
    for max_batch, max_queue in ((0, 1), (MAX_BATCH_LIMIT + 1, 1), (2.0, 1), (2, -1)):
        with pytest.raises(ValueError):
            check_limits(max_batch, max_queue)
    h = Harness(context_tokens=10)
    with pytest.raises(ValueError, match="context window"):
        h.submit(1, 8)  # 3 prompt tokens + 8 > 10
    with pytest.raises(ValueError, match="empty"):
        h.scheduler.submit([], GenerationSettings(max_new_tokens=1), eos_ids=set(),
                           stop=threading.Event(), stats=ReplyStats())
    assert h.scheduler.load()["waiting"] == 0 and not h.jobs


def test_a_request_whose_set_up_fails_ends_alone_with_its_error():
    runner = ListRunner()
    runner.bad_setup.add(2)
    h = Harness(runner, max_batch=3)
    good, bad, other = h.submit(1, 5), h.submit(2, 5), h.submit(3, 5)
    h.run()
    with pytest.raises(ValueError, match="seed"):
        list(bad[0])
    assert bad[1].finish_reason == "error"
    assert list(good[0]) == expected(1, 5) and list(other[0]) == expected(3, 5)


def test_a_group_whose_prefill_fails_is_prefilled_again_one_by_one():
    runner = ListRunner(padded=True)  # prompts that fit the padded prefill go as one group
    runner.bad_groups.add(2)
    h = Harness(runner, max_batch=3)
    streams = [h.submit(i, 5) for i in (1, 2, 3)]
    h.run()
    # Alone, request 2's prefill works (the fault was the group's): all three decode.
    assert runner.prefilled == [[1], [2], [3]]
    assert [list(s) for s, _ in streams] == [expected(i, 5) for i in (1, 2, 3)]


def test_a_resumed_reply_in_a_group_that_fails_for_another_goes_on_alone():
    runner = ListRunner(blocks=9, padded=True)  # room for one of the two long replies at a time
    runner.bad_groups.add(3)  # request 3 fails any group's prefill, not its own
    h = Harness(runner, max_batch=3)
    one, two = h.submit(1, 14), h.submit(2, 14)
    late = {}
    runner.on_step = lambda step, rows: step == 2 and late.setdefault("3", h.submit(3, 3))
    h.run()
    # Request 2 was preempted and resumed in one group with request 3: that group failed, and
    # each went on alone, request 2 from the tokens it had.
    assert h.scheduler.preemptions >= 1 and runner.prefilled[:3] == [[1, 2], [2], [3]]
    assert [list(s) for s, _ in (one, two, late["3"])] == \
        [expected(1, 14), expected(2, 14), expected(3, 3)]
    assert not runner.set_up_now


def drained(stream, timeout_s: float = 10.0) -> dict:
    """What reading a stream to its end gives, {} if it is still open after timeout_s."""
    result: dict = {}

    def read():
        try:
            result["tokens"] = list(stream)
        except Exception as error:  # noqa: BLE001 - the test looks at it
            result["error"] = error

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    return result


def test_a_failure_between_admission_and_prefill_ends_those_replies_and_the_next_goes_on(
        caplog):
    """A bug escaping admission after requests left the queue, before any had a row, left
    their streams open for ever: the loop's own failure handling knows only rows and queue.
    The failure is logged once, by the loop (it was logged as a failed prefill first)."""
    runner = ListRunner(padded=True)
    real = runner.fit_padded_together

    def broken(lengths):
        raise RuntimeError("grouping failed")

    runner.fit_padded_together = broken
    h = Harness(runner, max_batch=3)
    streams = [h.submit(i, 5) for i in (1, 2)]
    h.run()
    for stream, stats in streams:
        assert isinstance(drained(stream).get("error"), RuntimeError)
        assert stats.finish_reason == "error"
    logged = [r for r in caplog.records if r.exc_info and "grouping failed" in str(r.exc_info[1])]
    assert [r.getMessage() for r in logged] == ["batch loop failed"]
    runner.fit_padded_together = real
    later = h.submit(3, 5)
    h.run()
    assert drained(later[0]) == {"tokens": expected(3, 5)}


def test_a_row_whose_sampling_fails_ends_alone_and_the_others_go_on():
    runner = ListRunner()
    runner.bad_sampling[2] = 2  # request 2's sampling raises in the second step
    h = Harness(runner, max_batch=3)
    good, bad, other = h.submit(1, 8), h.submit(2, 8), h.submit(3, 8)
    h.run()
    with pytest.raises(RuntimeError, match="sampling failed"):
        list(bad[0])
    assert bad[1].finish_reason == "error"
    assert list(good[0]) == expected(1, 8) and list(other[0]) == expected(3, 8)
    assert not runner.set_up_now


# -- the KV cache's blocks ------------------------------------------------------------------------
def test_every_block_comes_back_and_finished_replies_stay_findable():
    h = Harness(max_batch=3)
    streams = [h.submit(i, 9) for i in (1, 2, 3)]
    h.run()
    assert [list(s) for s, _ in streams] == [expected(i, 9) for i in (1, 2, 3)]
    counts = h.runner.pool.counts()
    assert counts.used == 0  # nothing held once every reply ended
    # 3 prompt + 8 fed reply tokens each (the ninth was never fed): 5 full blocks of 2 named
    assert counts.cached == 3 * 5 and counts.free == counts.total - 15


def test_a_prompt_that_starts_like_an_earlier_conversation_reuses_its_blocks():
    h = Harness(max_batch=2, context_tokens=200)
    stats = ReplyStats()
    first = h.scheduler.submit([5, 10**6, 7, 8, 9], GenerationSettings(max_new_tokens=6),
                               eos_ids={EOS}, stop=threading.Event(), stats=stats)
    h.run()
    reply = list(first)
    assert stats.cached_tokens == 0
    # The next turn: the whole first exchange, then more (as a chat template renders it).
    follow = [5, 10**6, 7, 8, 9] + reply[:5] + [11, 12, 13]
    again = ReplyStats()
    second = h.scheduler.submit(follow, GenerationSettings(max_new_tokens=4), eos_ids={EOS},
                                stop=threading.Event(), stats=again)
    h.run()
    assert list(second) == expected(5, 4)
    # 5 + 5 = 10 tokens were fed before: all 5 blocks of 2 are found again
    assert again.cached_tokens == 10 == h.runner.prefill_log[-1][2]
    assert h.scheduler.kv_blocks()["reused_tokens"] == 10


def test_the_padded_prefill_computes_its_prompts_whole_instead_of_reusing():
    h = Harness(ListRunner(padded=True), max_batch=2)
    h.run()
    one, _ = h.submit(1, 3)
    h.run()
    list(one)
    again, stats = h.submit(1, 3)
    h.run()
    assert list(again) == expected(1, 3) and stats.cached_tokens == 0


def test_with_too_few_blocks_a_request_waits_for_them_and_the_queue_says_so():
    # 6 blocks of 2 tokens: a 3-token prompt and 9 new tokens take 6 blocks: one at a time.
    runner = ListRunner(blocks=7)
    h = Harness(runner, max_batch=3)
    streams = [h.submit(i, 9) for i in (1, 2, 3)]
    waited = []

    def on_step(step, rows):
        waited.append((len(rows), h.scheduler.load().get("waiting_for")))

    runner.on_step = on_step
    h.run()
    assert [list(s) for s, _ in streams] == [expected(i, 9) for i in (1, 2, 3)]
    assert ("KV cache blocks" in {w for _, w in waited})  # the queue's head said why it waited
    assert runner.pool.counts().used == 0


def test_a_reply_that_runs_out_of_blocks_takes_them_from_the_last_admitted_which_resumes():
    # 9 blocks: two replies of 3 + 14 tokens (9 blocks each at the end) cannot both finish.
    runner = ListRunner(blocks=10)
    h = Harness(runner, max_batch=2)
    early, late = h.submit(1, 14), h.submit(2, 14)
    h.run()
    assert list(early[0]) == expected(1, 14) and list(late[0]) == expected(2, 14)
    assert h.scheduler.preemptions >= 1
    # the second was sent back and prefilled again from its prompt and its reply so far
    resumed = [tokens for first, tokens, _ in runner.prefill_log if first == 2][1:]
    assert resumed and all(t[:3] == [2, 10**6, 7] and t[3:] == expected(2, len(t) - 3)
                           for t in resumed)
    assert early[1].finish_reason == late[1].finish_reason == "length"
    assert runner.pool.counts().used == 0
