"""The failed-login limiter on its own: a name locked after MAX_FAILURES stays locked while a
guesser fails at made-up names, and the kept pairs stay bounded."""

from __future__ import annotations

from server import login_limit
from server.login_limit import LoginLimiter


def test_a_locked_name_stays_locked_when_a_guesser_floods_other_names(monkeypatch):
    monkeypatch.setattr(login_limit, "MAX_TRACKED", 50)
    limiter = LoginLimiter(max_failures=3, window_s=300)
    for _ in range(3):
        limiter.failed("10.0.0.9", "alice", "test")
    assert limiter.wait_s("10.0.0.9", "alice") > 0
    # While alice is locked the app answers 429 without counting: her entry is never the
    # newest again, however many made-up names fail after it.
    for i in range(500):
        limiter.failed("10.0.0.9", f"made-up-{i}", "test")
        assert len(limiter._failures) <= 51
    assert limiter.wait_s("10.0.0.9", "alice") > 0


def test_failures_past_the_window_and_emptied_entries_go_first(monkeypatch):
    monkeypatch.setattr(login_limit, "MAX_TRACKED", 5)
    clock = [1000.0]
    monkeypatch.setattr(login_limit.time, "monotonic", lambda: clock[0])
    limiter = LoginLimiter(max_failures=2, window_s=60)
    for i in range(5):
        limiter.failed("10.0.0.1", f"old-{i}", "test")
    clock[0] += 120  # every one of those is past the window now
    assert limiter.wait_s("10.0.0.1", "old-0") == 0  # read once its failures expired
    assert ("10.0.0.1", "old-0") not in limiter._failures
    limiter.failed("10.0.0.2", "bob", "test")
    limiter.failed("10.0.0.2", "bob", "test")
    limiter.failed("10.0.0.2", "carol", "test")  # one over MAX_TRACKED: the expired ones go
    assert list(limiter._failures) == [("10.0.0.2", "bob"), ("10.0.0.2", "carol")]
    assert limiter.wait_s("10.0.0.2", "bob") > 0
