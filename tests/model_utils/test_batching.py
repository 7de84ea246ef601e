"""Concurrent replies decoded together: exact replies, Stop frees a place, a full queue refuses.

Everything on the CPU with the fp32 demo model, where the batched step (padding, masks, rows
moving) must give exactly the tokens of a reply decoded alone.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from model_utils.bench.measure import settle
from model_utils.engine import Engine, eos_ids
from model_utils.errors import ModelBusy, QueueFull
from model_utils.runtime.decoders import EagerDecoder
from model_utils.runtime.generation import decode_tokens
from model_utils.runtime.generation_settings import GenerationSettings
from model_utils.runtime.reply_stats import ReplyStats

from .helpers import cpu_request, prefill_logits, record_padded_prefills, submitted_together


def greedy(n: int, *, fixed: bool = True) -> GenerationSettings:
    return GenerationSettings(max_new_tokens=n, min_new_tokens=n if fixed else 0,
                              temperature=0.0, top_p=1.0, top_k=0, repetition_penalty=1.0)


def run_together(jobs: list) -> list:
    """Run the callables at the same moment, one thread each; their results in order."""
    results: list = [None] * len(jobs)
    errors: list = []
    start = threading.Barrier(len(jobs))

    def one(i):
        start.wait()
        try:
            results[i] = jobs[i]()
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    return results


def wait_until(condition, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def submit(serving, prompt, settings, stop=None) -> tuple[list[int], ReplyStats]:
    stats = ReplyStats()
    tokens = list(serving.scheduler.submit(prompt, settings, eos_ids=eos_ids(serving.loaded),
                                        stop=stop or threading.Event(), stats=stats))
    return tokens, stats


def alone(serving, prompt, settings) -> list[int]:
    """The reference: the single-stream eager decoder (dynamic cache, no batch, no mask)."""
    return list(decode_tokens(EagerDecoder(serving.loaded.model), prompt, settings,
                              eos_ids=eos_ids(serving.loaded)))


@pytest.fixture(scope="module")
def small_engine(demo_path):
    """An engine of 3 rows and a queue of 4, for tests of places and the queue."""
    engine = Engine(max_batch=3, max_queue=4, busy_timeout_s=1.0)
    engine.load(cpu_request("fp32"))
    yield engine
    engine.unload()


def test_eight_concurrent_greedy_chats_get_the_reply_they_get_alone(load_demo):
    engine = load_demo("fp32")
    assert engine.max_batch == 8
    conversations = [[{"role": "user", "content": f"Question {i}: " + "tell me more. " * i}]
                     for i in range(8)]
    settings = [greedy(24 + 6 * i) for i in range(8)]
    expected = [engine.generate_text(c, s, thinking=False) for c, s in zip(conversations,
                                                                           settings)]
    together = submitted_together(engine, [
        lambda c=c, s=s: engine.generate_text(c, s, thinking=False)
        for c, s in zip(conversations, settings)])
    for i, (mine, theirs) in enumerate(zip(together, expected)):
        assert (mine.reasoning, mine.answer) == (theirs.reasoning, theirs.answer), i
        assert mine.stats.new_tokens == theirs.stats.new_tokens == 24 + 6 * i
        assert mine.stats.finish_reason == "length"
    # They really shared decode steps, all eight at once at some point.
    assert max(r.stats.batched_with for r in together) == 8
    assert all(r.stats.batched_with >= 2 for r in together)


def joining_and_leaving(serving) -> None:
    """Three rows for seven requests: requests wait, join while others decode, leave at
    different times (rows move), and rows of 5 and 1100 tokens decode in the same steps,
    each over its own blocks. Sampled requests use their own seed and the repetition penalty;
    each must equal the single-stream decoder's reply."""
    sampled = GenerationSettings(max_new_tokens=40, temperature=0.8, top_p=0.9, top_k=20,
                                 repetition_penalty=1.3, seed=7)
    cases = [
        ([11, 12, 13, 14, 15], greedy(120)),
        ([(7 * i) % 500 + 5 for i in range(1100)], greedy(30)),
        ([20 + i for i in range(40)], sampled),
        ([30 + i for i in range(9)], greedy(90, fixed=False)),
        ([(3 * i) % 400 + 5 for i in range(300)], greedy(60)),
        ([40, 41], GenerationSettings(max_new_tokens=50, temperature=0.0, top_p=1.0, top_k=0,
                                      repetition_penalty=1.2)),
        ([50 + i for i in range(17)], greedy(8)),
    ]
    expected = [alone(serving, p, s) for p, s in cases]
    got = run_together([lambda p=p, s=s: submit(serving, p, s) for p, s in cases])
    for i, ((tokens, stats), reference) in enumerate(zip(got, expected)):
        assert tokens == reference, f"request {i} differs at token " \
            f"{next((k for k, (a, b) in enumerate(zip(tokens, reference)) if a != b), '-')}"
        assert stats.new_tokens == len(tokens)
    assert serving.scheduler.peak_rows == 3
    assert serving.scheduler.load()["active"] == 0


def test_rows_joining_leaving_and_moving_keep_every_reply_exact(small_engine):
    joining_and_leaving(small_engine.serving)


def test_the_padded_prefill_gives_the_replies_of_an_unpadded_one(small_engine):
    """The prefill a GPU replays as CUDA graphs (prompts right-padded to a bucket length,
    prefill.py), run eagerly here: every reply as above must be unchanged,
    the padded prefill must really have served the short prompts, and the 1100-token prompt
    (longer than any bucket) the eager one."""
    serving = small_engine.serving
    runner = serving.scheduler.runner
    small_engine.worker.call(runner.warm_up)  # allocates the batch cache
    small_engine.worker.call(lambda: runner.use_padded_prefill())
    padded = runner.padded_prefill
    served = record_padded_prefills(runner)
    try:
        assert padded.buckets == (64, 128, 256, 512, 1024)
        joining_and_leaving(serving)
    finally:
        runner.padded_prefill = None
    assert sorted(sum(served, [])) == [2, 5, 9, 17, 40, 300]


def test_prompts_arriving_together_share_one_padded_prefill(load_demo):
    """Eight prompts waiting at once are prefilled by one padded forward (8 rows of the
    64-token bucket: one replay on a GPU), and each reply is still the one it gets alone."""
    engine = load_demo("fp32")
    serving = engine.serving
    runner = serving.scheduler.runner
    engine.worker.call(runner.warm_up)  # allocates the batch cache
    engine.worker.call(lambda: runner.use_padded_prefill())
    groups = record_padded_prefills(runner)
    cases = [([5 + i + j for j in range(3 + 7 * i)], greedy(16 + i)) for i in range(8)]
    try:
        expected = [alone(serving, p, s) for p, s in cases]
        results = submitted_together(engine, [lambda c=c: submit(serving, *c) for c in cases])
    finally:
        runner.padded_prefill = None
    assert groups == [[3 + 7 * i for i in range(8)]]
    for i, ((tokens, _), reference) in enumerate(zip(results, expected)):
        assert tokens == reference, i


def test_prompts_waiting_together_give_the_replies_they_get_alone(small_engine):
    """Requests that wait together are admitted together (each prefilled by itself here, as
    prompts the padded prefill does not take are)."""
    serving = small_engine.serving
    sampled = GenerationSettings(max_new_tokens=30, min_new_tokens=30, temperature=0.7,
                                 top_p=0.9, top_k=0, repetition_penalty=1.0, seed=3)
    cases = [([5 + i for i in range(60)], greedy(30)), ([300, 301, 302], sampled),
             ([(11 * i) % 500 + 3 for i in range(17)], greedy(30))]
    expected = [alone(serving, p, s) for p, s in cases]
    # Keep the worker busy so that all three are waiting when the loop starts.
    gate = threading.Event()
    small_engine.worker.post(gate.wait)
    try:
        streams = [serving.scheduler.submit(p, s, eos_ids=eos_ids(serving.loaded),
                                         stop=threading.Event(), stats=ReplyStats())
                   for p, s in cases]
        assert serving.scheduler.load()["waiting"] == 3
    finally:
        gate.set()  # a failed check must not leave the worker blocked for the next tests
    assert [list(stream) for stream in streams] == expected


def test_stop_frees_the_place_within_a_step_and_the_others_complete(small_engine):
    serving = small_engine.serving
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(4)]
    long = greedy(3000)
    stops = [threading.Event() for _ in prompts]
    extra_after_stop: list[int] = []
    results: list = [None] * 4

    def stopped_after(i, n):
        stats, count, made = ReplyStats(), 0, 0
        for _ in serving.scheduler.submit(prompts[i], long, eos_ids=eos_ids(serving.loaded),
                                       stop=stops[i], stats=stats):
            count += 1
            if count == n:
                made = stats.new_tokens  # tokens made so far (some may still be queued)
                stops[i].set()
        extra_after_stop.append(stats.new_tokens - made)
        results[i] = stats

    def complete(i, n):
        results[i] = submit(serving, prompts[i], greedy(n))

    # Three rows: two long replies and a short one fill them; the fourth waits for a place,
    # which only the Stop of a long reply gives it in time. The worker is held until all four
    # wait, in that order, so the first three take the rows however slow the machine is.
    first = threading.Thread(target=stopped_after, args=(0, 20))
    second = threading.Thread(target=stopped_after, args=(1, 400))
    third = threading.Thread(target=complete, args=(2, 60))
    fourth = threading.Thread(target=complete, args=(3, 30))
    gate = threading.Event()
    small_engine.worker.post(gate.wait)
    try:
        for n, thread in enumerate((first, second, third, fourth), 1):
            thread.start()
            wait_until(lambda n=n: serving.scheduler.load()["waiting"] == n)
    finally:
        gate.set()  # a failed check must not leave the worker blocked for the next tests
    for t in (first, second, third, fourth):
        t.join(timeout=300)
    assert results[0].finish_reason == "stop" and results[0].stopped
    assert max(extra_after_stop) <= 1  # at most the token of the step already running
    for i, n in ((2, 60), (3, 30)):
        tokens, stats = results[i]
        assert tokens == alone(serving, prompts[i], greedy(n)) and stats.finish_reason == "length"
    assert results[1].finish_reason == "stop"
    assert serving.scheduler.load() == {"active": 0, "waiting": 0, "max_batch": 3, "max_queue": 4}


def test_closing_the_chat_stream_frees_its_place(small_engine):
    """A closed browser tab closes engine.chat's generator: its place is free again."""
    batcher = small_engine.serving.scheduler
    stream = small_engine.chat([{"role": "user", "content": "hi"}], greedy(3000))
    next(stream)
    assert batcher.load()["active"] == 1
    stream.close()
    wait_until(lambda: batcher.load()["active"] == 0)


def test_a_full_queue_refuses_at_once_with_a_busy_error(small_engine):
    serving = small_engine.serving
    stops = [threading.Event() for _ in range(7)]
    streams = [serving.scheduler.submit([5 + i, 6, 7], greedy(4000), eos_ids=eos_ids(serving.loaded),
                                     stop=stops[i], stats=ReplyStats()) for i in range(7)]
    assert serving.scheduler.load()["active"] + serving.scheduler.load()["waiting"] == 7
    with pytest.raises(QueueFull) as caught:
        next(small_engine.chat([{"role": "user", "content": "one more"}], greedy(4)))
    # Refused while all seven are still in flight: it did not wait for a place to free up.
    assert serving.scheduler.load()["active"] + serving.scheduler.load()["waiting"] == 7
    assert "busy" in str(caught.value) and "try again" in str(caught.value)
    assert isinstance(caught.value, ModelBusy)  # what the UI already shows as a message
    for stop in stops:
        stop.set()
    for stream in streams:
        list(stream)  # each ends (stopped or never started) instead of hanging
    reply = small_engine.generate_text([{"role": "user", "content": "again"}], greedy(4))
    assert reply.stats.new_tokens == 4


def test_a_switch_waits_for_streaming_replies_and_never_corrupts_them(small_engine):
    serving = small_engine.serving
    prompt = [9, 8, 7, 6]
    stop = threading.Event()
    tokens: list[int] = []
    stats = ReplyStats()

    def reply():
        with small_engine.manager.use():  # what engine.chat holds while it streams
            tokens.extend(serving.scheduler.submit(prompt, greedy(4000), eos_ids=eos_ids(serving.loaded),
                                                stop=stop, stats=stats))

    thread = threading.Thread(target=reply)
    thread.start()
    wait_until(lambda: serving.scheduler.load()["active"] == 1 or not thread.is_alive())
    with pytest.raises(ModelBusy):  # busy_timeout_s is 1 s: the reply is still streaming
        small_engine.load(cpu_request("fp16"))
    # Enough of the reply to compare, however many tokens the busy wait above lasted.
    wait_until(lambda: stats.new_tokens >= 100 or not thread.is_alive())
    stop.set()
    thread.join(timeout=300)
    assert small_engine.status()["mode"] == "fp32"
    assert stats.finish_reason == "stop" and len(tokens) >= 100
    assert tokens[:100] == alone(serving, prompt, greedy(100))


def test_a_reply_that_cannot_fit_its_row_is_refused_before_it_joins(small_engine):
    serving = small_engine.serving
    with pytest.raises(ValueError, match="context window"):
        serving.scheduler.submit([5] * 100, greedy(4000), eos_ids=eos_ids(serving.loaded),
                              stop=threading.Event(), stats=ReplyStats())
    assert serving.scheduler.load()["waiting"] == 0


def test_with_memory_for_few_blocks_replies_wait_or_resume_and_stay_exact(demo_path,
                                                                         monkeypatch):
    """A KV cache of 17 blocks (the least a 256-token context gets) for five replies that
    need 20 at their end: some wait for blocks, or are preempted and resumed from their tokens
    so far; every reply is still the one it gets alone, and every block comes back."""
    import model_utils.runtime.runner as runner

    monkeypatch.setattr(runner, "_free_bytes", lambda device: 1)
    engine = Engine(max_batch=8)
    engine.load(cpu_request("fp32", context_tokens=256))
    try:
        serving = engine.serving
        prompts = [[10 + i] + [(7 * j + i) % 300 + 5 for j in range(19)] for i in range(5)]
        expected = [alone(serving, p, greedy(40)) for p in prompts]
        gate = threading.Event()
        engine.worker.post(gate.wait)  # all five wait when the loop starts
        try:
            streams = [serving.scheduler.submit(p, greedy(40), eos_ids=eos_ids(serving.loaded),
                                             stop=threading.Event(), stats=ReplyStats())
                       for p in prompts]
        finally:
            gate.set()
        assert [list(stream) for stream in streams] == expected
        blocks = serving.scheduler.kv_blocks()
        assert blocks["total"] == 17 and blocks["used"] == 0
        assert blocks["preemptions"] >= 1
    finally:
        engine.unload()


def test_the_next_turn_reuses_the_conversation_so_far_and_gets_the_same_reply(load_demo):
    engine = load_demo("fp32")
    serving = engine.serving
    first = [(5 * i) % 400 + 7 for i in range(300)]
    reply, stats = submit(serving, first, greedy(30))
    assert stats.cached_tokens == 0
    follow = first + reply + [11, 12, 13, 14]
    again, stats = submit(serving, follow, greedy(20))
    # 300 + 29 fed tokens were cached: 20 full blocks of 16
    assert stats.cached_tokens == 320
    assert again == alone(serving, follow, greedy(20))
    # A short prompt that starts like an earlier one is computed whole (MIN_REUSE_TOKENS)
    _, stats = submit(serving, first[:100] + [9, 9], greedy(4))
    assert stats.cached_tokens == 0


def test_a_long_prompt_prefilled_in_chunks_gives_the_logits_of_one_forward(load_demo):
    engine = load_demo("fp32")
    tokens = [(11 * i) % 500 + 3 for i in range(300)]

    def logits(chunk):
        return prefill_logits(engine, tokens, chunk)

    whole = logits(1000)
    for chunk in (64, 100):
        torch.testing.assert_close(logits(chunk), whole, rtol=1e-4, atol=1e-4)


def test_a_short_tail_after_a_cached_start_decoded_as_rows_gives_the_same_logits(load_demo):
    """The next turn's new tokens as rows of one decode step (what a GPU replays as one graph),
    on the CPU's eager step: the logits of the one-sequence forward and of the whole prompt."""
    engine = load_demo("fp32")
    runner = engine.serving.scheduler.runner
    start = [(7 * i) % 450 + 5 for i in range(300)]

    def extend(tail: list[int], tail_rows: int) -> torch.Tensor:
        def run():
            pool = runner.blocks()
            tokens = start + tail
            blocks = pool.allocate(-(-len(tokens) // pool.block_size))
            saved, runner.tail_rows = runner.tail_rows, tail_rows
            try:
                with torch.inference_mode():
                    runner.forward_prompt(start, blocks)  # the conversation so far, cached
                    return runner.forward_prompt(tokens, blocks, cached=len(start))
            finally:
                runner.tail_rows = saved
                pool.release(blocks)

        return engine.worker.call(run)

    for tail in ([9], [(3 * i) % 300 + 2 for i in range(40)]):  # 40: over three block edges
        as_rows = extend(tail, 64)
        torch.testing.assert_close(as_rows, extend(tail, 0), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(as_rows, prefill_logits(engine, start + tail, 1000),
                                   rtol=1e-4, atol=1e-4)
    assert extend([4] * 65, 64).shape == (1, runner.model.config.vocab_size)  # too long: whole


def test_a_next_turn_decoded_as_rows_gets_the_reply_it_gets_alone(load_demo):
    engine = load_demo("fp32")
    serving = engine.serving
    runner = serving.scheduler.runner
    saved, runner.tail_rows = runner.tail_rows, 64
    try:
        first = [(13 * i) % 420 + 9 for i in range(290)]
        reply, _ = submit(serving, first, greedy(24))
        follow = first + reply + [21, 22, 23, 24, 25]
        again, stats = submit(serving, follow, greedy(16))
        assert stats.cached_tokens == 304  # 19 full blocks of the 313 fed tokens
        assert again == alone(serving, follow, greedy(16))
    finally:
        runner.tail_rows = saved


def test_prefill_shapes_left_for_later_are_set_up_one_a_job_while_the_worker_is_idle(small_engine):
    """A load sets up the largest prefill shape (the graphs' pool at its size) and leaves the
    others to the worker's idle time: one prompt's shapes first, nothing while busy, nothing
    once the model is unloaded (the CPU runs them eagerly; a GPU captures them)."""
    runner = small_engine.serving.scheduler.runner
    worker = small_engine.worker
    worker.call(runner.warm_up)  # allocates the batch cache
    try:
        worker.call(lambda: runner.use_padded_prefill(largest_only=True))
        padded = runner.padded_prefill
        assert padded.pool_shape() == (1, 1024)  # of (8, 128), (4, 256), (2, 512), (1, 1024)
        assert padded.pending()[:4] == [(1, 64), (1, 128), (1, 256), (1, 512)]
        assert len(padded.pending()) == len(padded.shapes) - 1

        busy, cancelled = threading.Event(), threading.Event()
        busy.set()
        asked = []
        worker.post_while_idle(padded.capture_next, lambda: asked.append(1) or busy.is_set(),
                               cancelled)
        time.sleep(0.5)
        assert len(padded.pending()) == len(padded.shapes) - 1  # nothing while busy
        assert 3 <= len(asked) <= 20  # asked again every 50 ms or so: no spinning
        with worker.idle_lock:  # another thread's GPU call: no step while it runs
            busy.clear()
            time.sleep(0.2)
            assert len(padded.pending()) == len(padded.shapes) - 1
        settle(small_engine)  # what the benchmarks wait for
        assert padded.pending() == []

        worker.call(lambda: runner.use_padded_prefill(largest_only=True))
        left = runner.padded_prefill.pending()
        cancelled.set()
        worker.post_while_idle(runner.padded_prefill.capture_next, busy.is_set, cancelled)
        worker.call(lambda: None)
        assert runner.padded_prefill.pending() == left  # the model went: nothing more
        settle(small_engine, stall_s=0.3)  # nothing sets them up: the wait gives up
        assert runner.padded_prefill.pending() == left
    finally:
        runner.padded_prefill = None
