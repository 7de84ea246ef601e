"""The status version pages poll, and the one background memory sampler they all read."""

from __future__ import annotations

import threading
import time

import pytest

from model_utils.errors import LoadError
from model_utils.memory import MemoryHistory

from .helpers import cpu_request


def test_every_load_unload_and_failed_load_moves_the_status_version(load_demo):
    engine = load_demo("fp32")
    seen = engine.status_version()
    assert engine.status_version() == seen  # reading it changes nothing
    engine.load(cpu_request("bf16"))
    after_switch = engine.status_version()
    assert after_switch > seen
    engine.unload()
    after_unload = engine.status_version()
    assert after_unload > after_switch and engine.status()["loaded"] is False
    with pytest.raises(LoadError):
        engine.load(cpu_request("fp32", model="/nonexistent/model"))
    # A refused load changed nothing, but one that failed half-way may have put the previous
    # model back: the version moves either way, and pages re-read the status once.
    assert engine.status_version() > after_unload
    engine.load(cpu_request("fp32"))


def wait_for(check, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_sampler_records_without_any_reader_and_runs_once():
    history = MemoryHistory(max_points=50)
    assert not history.sampling
    history.start_sampling(interval_s=0.05)
    history.start_sampling(interval_s=0.05)  # a second start does not add a thread
    try:
        samplers = [t for t in threading.enumerate() if t.name == "memory-sampler"]
        assert len(samplers) == 1
        wait_for(lambda: len(history.points()) >= 3)
        times = [p.time for p in history.points()]
        assert times == sorted(times)
        assert history.latest() is history.points()[-1]  # read, not a new reading
        count = len(history.points())
        history.latest()
        assert len(history.points()) >= count  # reading never adds a point by itself
    finally:
        history.stop_sampling()
    assert not history.sampling


def test_latest_without_a_sampler_is_fresh_and_not_recorded():
    history = MemoryHistory()
    snap = history.latest()
    assert snap.process_rss_gb > 0
    assert history.points() == []
