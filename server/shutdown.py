"""Graceful shutdown on SIGTERM / SIGINT: stop admitting, let open replies finish for a few
seconds, end the rest with an error (an error event and [DONE] on /v1, an error status on
/chat, a message on the page), then close the server.

Without this, SIGTERM killed the process at once (exit 143): open streams were cut mid-chunk
with no error and no [DONE], and the log said nothing.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

log = logging.getLogger("app")

CLOSING = "the server is shutting down: try again when it is back"
ENDED = "the server shut down before this reply was complete"
# After the replies' streams have ended, time for the web server to send their last events.
FLUSH_S = 1.0


def wait_for_signal() -> str:
    """Block until SIGTERM or SIGINT; returns the signal's name."""
    received: list[str] = []
    done = threading.Event()

    def on_signal(signum, _frame):
        received.append(signal.Signals(signum).name)
        done.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    while not done.wait(0.5):  # a timed wait, so that the handler runs promptly
        pass
    return received[0]


# What else must end with the server, each called with the grace period in seconds (a
# training run: it would otherwise outlive the server, re-parented to PID 1).
_ON_SHUTDOWN: list = []


def on_shutdown(callback) -> None:
    """callback(grace_s) runs, beside the replies' grace period, when the server closes."""
    _ON_SHUTDOWN.append(callback)


def shut_down(engine, demo, *, why: str, grace_s: float) -> None:
    open_now = engine.open_replies()
    log.info("shutting down (%s): no new requests; %d open replies get up to %.0f s to finish",
             why, open_now, grace_s)
    engine.stop_admitting(CLOSING)
    others = [threading.Thread(target=callback, args=(grace_s,), daemon=True)
              for callback in _ON_SHUTDOWN]
    for thread in others:
        thread.start()
    if not _wait(lambda: engine.open_replies() == 0, grace_s):
        ended = engine.end_replies(ENDED)
        log.warning("shutting down: %d replies still open after %.0f s were ended", ended,
                    grace_s)
        _wait(lambda: engine.open_replies() == 0, 10.0)
    for thread in others:
        thread.join(timeout=grace_s + 10.0)
    time.sleep(FLUSH_S)
    demo.close(verbose=False)
    log.info("shut down")


def _wait(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True
