"""The model server's health: a periodic GET /models, timed, on a thread of its own.

The result is what status() reports (so a page refresh costs no request to the server) and
what the model list comes from. A server that is down is asked again every `retry_s`; one that
is up every `interval_s`. Replies never wait for this: each one tries the server itself, so the
first request after the server comes back works even before the next check.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Health:
    ok: bool = False
    checked_at: float = 0.0  # time.time() of the last check, 0 before the first
    latency_ms: float | None = None
    error: str = ""
    models: tuple[dict, ...] = ()
    since: float = field(default_factory=time.time)  # when ok last changed

    def as_dict(self) -> dict:
        return {"ok": self.ok, "checked_at": round(self.checked_at, 3),
                "latency_ms": None if self.latency_ms is None else round(self.latency_ms, 1),
                "error": self.error, "since": round(self.since, 3)}


class HealthMonitor:
    def __init__(self, fetch_models: Callable[[], list[dict]], *, name: str,
                 interval_s: float = 10.0, retry_s: float = 3.0):
        self._fetch = fetch_models
        self.name = name  # the server's address without credentials, for the log
        self.interval_s, self.retry_s = interval_s, retry_s
        self._health = Health()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def health(self) -> Health:
        return self._health

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="backend-health", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed.set()

    def check_now(self) -> Health:
        start = time.perf_counter()
        try:
            models = self._fetch()
        except Exception as error:  # noqa: BLE001 - any failure is "down", with its reason
            return self.record(ok=False, error=str(error))
        return self.record(ok=True, models=tuple(models),
                           latency_ms=(time.perf_counter() - start) * 1000)

    def record(self, *, ok: bool, error: str = "", models: tuple[dict, ...] | None = None,
               latency_ms: float | None = None) -> Health:
        """Note a result: from the periodic check, or from a reply that found the server
        down (or up again) before the next check did."""
        with self._lock:
            old = self._health
            new = replace(old, ok=ok, error=error, checked_at=time.time(),
                          latency_ms=latency_ms if ok else None,
                          models=old.models if models is None else models,
                          since=old.since if old.ok == ok and old.checked_at else time.time())
            self._health = new
        if ok and not (old.ok and old.checked_at):
            log.info("model server %s is up: %s", self.name,
                     ", ".join(m["id"] for m in new.models) or "no models")
        elif not ok and (old.ok or not old.checked_at):
            log.warning("model server %s is down: %s (retrying every %g s)", self.name, error,
                        self.retry_s)
        return new

    def _loop(self) -> None:
        while not self._closed.is_set():
            health = self.check_now()
            self._closed.wait(self.interval_s if health.ok else self.retry_s)
