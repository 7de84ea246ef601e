"""The failed-login limiter on its own: a name locked after MAX_FAILURES stays locked while
others fail, however many made-up names a guesser tries, and the kept pairs stay bounded."""

from __future__ import annotations

from server import login_limit
from server.login_limit import LoginLimiter


def test_a_locked_name_stays_locked_when_a_guesser_floods_other_names(monkeypatch):
    monkeypatch.setattr(login_limit, "MAX_TRACKED", 50)
    limiter = LoginLimiter(max_failures=3, window_s=300)
    for _ in range(3):
        limiter.failed("10.0.0.9", "alice", "test")
    assert limiter.wait_s("10.0.0.9", "alice") > 0
    for i in range(40):  # fewer than MAX_TRACKED: nothing is dropped
        limiter.failed("10.0.0.9", f"made-up-{i}", "test")
    assert limiter.wait_s("10.0.0.9", "alice") > 0
    limiter.failed("10.0.0.9", "alice", "test")  # still failing: the newest again
    for i in range(40, 200):  # past MAX_TRACKED: the names that failed longest ago go first
        limiter.failed("10.0.0.9", f"made-up-{i}", "test")
        if i % 30 == 0:
            limiter.failed("10.0.0.9", "alice", "test")
    assert limiter.wait_s("10.0.0.9", "alice") > 0
    assert len(limiter._failures) <= 50


def test_failures_past_the_window_are_dropped_first(monkeypatch):
    monkeypatch.setattr(login_limit, "MAX_TRACKED", 5)
    clock = [1000.0]
    monkeypatch.setattr(login_limit.time, "monotonic", lambda: clock[0])
    limiter = LoginLimiter(max_failures=2, window_s=60)
    for i in range(5):
        limiter.failed("10.0.0.1", f"old-{i}", "test")
    clock[0] += 120  # every one of those is past the window now
    limiter.failed("10.0.0.2", "bob", "test")
    limiter.failed("10.0.0.2", "bob", "test")
    assert list(limiter._failures) == [("10.0.0.2", "bob")]
    assert limiter.wait_s("10.0.0.2", "bob") > 0
