"""The benchmark on a loaded model shares the engine with users: replies are served promptly
while it runs, and its sizes are capped whatever is asked."""

from __future__ import annotations

import threading
import time

import pytest

from model_utils.bench.gate import Gate
from model_utils.bench.per_mode import LOADED_LIMITS, bench_loaded
from model_utils.runtime.generation_settings import GenerationSettings

from .helpers import HELLO

REPLY = GenerationSettings(max_new_tokens=24, min_new_tokens=24, temperature=0.0)


def timed_reply(engine) -> float:
    start = time.perf_counter()
    final = engine.generate_text(HELLO, REPLY, thinking=False)
    assert final.stats.new_tokens == 24
    return time.perf_counter() - start


def test_a_reply_during_a_benchmark_is_served_within_a_bound_of_its_solo_time(load_demo):
    engine = load_demo("fp32")
    timed_reply(engine)  # first reply after load
    solo = sorted(timed_reply(engine) for _ in range(3))[1]
    gate = Gate(engine)
    box = {}

    def bench():
        try:
            box["rows"] = bench_loaded(engine, prompt_tokens=32, new_tokens=48,
                                       batches=(1,), match_prompts=1, gate=gate)
        except BaseException as error:  # noqa: BLE001 - reported below
            box["error"] = error

    thread = threading.Thread(target=bench)
    thread.start()
    during = []
    while thread.is_alive() and len(during) < 4:
        # A message arriving while the benchmark holds the decode worker (plain generate or
        # the teacher-forced run): the worst moment for a reply. Sent as a call begins, not
        # near its end, where the call could finish before the message reaches the queue.
        while thread.is_alive() and gate.in_call.is_set():
            time.sleep(0.01)
        while thread.is_alive() and not gate.in_call.wait(timeout=0.5):
            pass
        if thread.is_alive():
            during.append(timed_reply(engine))
            time.sleep(solo)  # reading the reply, typing the next message
    thread.join(timeout=600)
    assert "error" not in box, box.get("error")
    assert [r.batch for r in box["rows"]] == [1]
    assert len(during) >= 2
    # Plain generate and the teacher-forced run gave way to each of those replies (else a
    # reply waited for a whole generate), and no reply waited for the benchmark's end.
    assert gate.interruptions >= len(during) - 1
    bound = 10 * solo + 5.0  # generous: the CPU is shared, and replies join the bench's batch
    print(f"solo {solo:.2f} s, during {[round(d, 2) for d in during]}, yielded {gate.interruptions}")
    assert max(during) <= bound, (solo, during)


@pytest.mark.parametrize("sizes", [{"prompt_tokens": LOADED_LIMITS["prompt_tokens"] + 1},
                                   {"new_tokens": LOADED_LIMITS["new_tokens"] + 1},
                                   {"batches": (LOADED_LIMITS["batch"] * 2,)},
                                   {"match_prompts": 99}, {"batches": ()}])
def test_sizes_beyond_the_caps_are_refused_before_anything_runs(load_demo, sizes):
    engine = load_demo("fp32")
    with pytest.raises(ValueError, match="between"):
        bench_loaded(engine, **sizes)
