"""Failed logins, wherever a password is checked (gradio's /login form, and the bearer token or
HTTP basic auth of /v1 and the API docs): each one logged (user name and address, never the
password), and after MAX_FAILURES for one user name from one address within WINDOW_S the
next attempts for it are refused (429) until the oldest failure is that old. Without this a
password could be guessed at the speed of the network and the log said nothing. One limiter
serves every way in, so a guesser gets no more tries by switching between them.

Keyed by (address, user name): a guesser at one name does not lock the others out, nor the
same name out of other addresses.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from urllib.parse import parse_qs

log = logging.getLogger("ui")

LOGIN_PATHS = ("/login", "/login/")
MAX_FAILURES = 5
WINDOW_S = 300.0
MAX_FORM_BYTES = 64 * 1024  # a login form is a name and a password
MAX_TRACKED = 10_000  # (address, user name) pairs whose failures are kept


class LoginLimiter:
    def __init__(self, max_failures: int = MAX_FAILURES, window_s: float = WINDOW_S):
        self.max_failures = max_failures
        self.window_s = window_s
        self._failures: dict[tuple[str, str], deque] = {}
        self._lock = threading.Lock()

    def wait_s(self, address: str, user: str) -> float:
        """Seconds until this user name may be tried again from this address (0: now)."""
        now = time.monotonic()
        with self._lock:
            failures = self._failures.get((address, user))
            if not failures:
                return 0.0
            while failures and now - failures[0] > self.window_s:
                failures.popleft()
            if not failures:
                del self._failures[(address, user)]
            if len(failures) < self.max_failures:
                return 0.0
            return self.window_s - (now - failures[0])

    def failed(self, address: str, user: str, via: str) -> None:
        """Count a failure; `via` says how the login came (for the log line)."""
        log.warning("login failed for user %r from %s (%s)", user[:64], address, via)
        now = time.monotonic()
        with self._lock:
            failures = self._failures.pop((address, user), None) or deque()
            failures.append(now)
            self._failures[(address, user)] = failures  # the most recent failure last
            if len(self._failures) > MAX_TRACKED:
                self._make_room(now)

    def _make_room(self, now: float) -> None:
        """Bounded, whoever sends names, down to 90 % of MAX_TRACKED (so that a flood pays
        this scan once per thousand failures, not at each): failures past the window go
        first, then the names not locked that failed longest ago, and locked names only
        when nothing else is left. Not everything at once, nor a locked name before others:
        a guesser could then unlock a name by failing at made-up ones."""
        target = MAX_TRACKED * 9 // 10
        expired = [k for k, f in self._failures.items() if not f or now - f[-1] > self.window_s]
        for key in expired:
            del self._failures[key]
        for locked in (False, True):
            if len(self._failures) <= target:
                return
            for key in [k for k, f in self._failures.items()
                        if (len(f) >= self.max_failures) == locked]:
                del self._failures[key]
                if len(self._failures) <= target:
                    return

    def succeeded(self, address: str, user: str) -> None:
        with self._lock:
            self._failures.pop((address, user), None)


def form_user(body: bytes) -> str:
    """The user name of a login form (urlencoded); "" when it has none."""
    try:
        values = parse_qs(body.decode("utf-8", "replace"), max_num_fields=10)
    except ValueError:
        return ""
    return (values.get("username") or [""])[0]
