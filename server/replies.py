"""Streaming one reply from the engine, shared by the chat panel and the /chat endpoint.

Owns the three things both need: turning settings into GenerationSettings, turning the engine's
input errors into gr.Error (so the browser shows a message and an API client gets an error
status), and the per-session Stop signal.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING

from model_utils.chat.updates import ChatUpdate

if TYPE_CHECKING:
    from model_utils.engine import Engine
from model_utils.runtime.generation_settings import GenerationSettings, public
from model_utils.runtime.reply_stats import ReplyStats

from .common import user_error
from .errors import client_error

log = logging.getLogger("ui")

# The settings a page or a request may give, in the panel's order (declared once, with their
# ranges and defaults, in model_utils/runtime/generation_settings.py).
SETTING_NAMES = tuple(s.name for s in public())


def make_settings(values: dict | None) -> GenerationSettings:
    """{name: value} -> GenerationSettings, checked at the door; None or a missing key means
    the model's default. An unknown name or a bad value raises InvalidParameter (mapped once,
    by errors.client_error, to a 400 or a gr.Error naming the setting)."""
    return GenerationSettings.from_values(values)


def stats_line(stats: ReplyStats | None, mode: str, *, no_answer: bool = False) -> str:
    """The line under a reply. `no_answer`: it reasoned and wrote no answer, which a reply
    cut by max_new_tokens says in words (raising the limit is the fix)."""
    if stats is None:
        return ""
    line = f"{stats.line()} · {mode}"
    if stats.stopped:
        line += " · stopped"
    elif stats.finish_reason == "length" and no_answer:
        line += " · hit max_new_tokens while reasoning: no answer yet (raise max_new_tokens)"
    elif stats.finish_reason == "length":
        line += " · hit max_new_tokens"
    return line


def waiting_notice(status: dict) -> str:
    """What a reply sent now waits for, in words ("" for nothing the page should name): the
    compile a load left for idle time (--compile-while-idle) runs to its end before a reply's
    first token."""
    if (seconds := status.get("compiling_for_s")) is None:
        return ""
    return (f"The model is compiling its faster decode step (started {seconds:.0f} s ago, left "
            "for idle time after the load); the reply starts once that is done.")


def stream(engine: Engine, messages: list[dict], settings: GenerationSettings, *,
           system_prompt: str, thinking: bool, stop: threading.Event) -> Iterator[ChatUpdate]:
    """engine.chat with errors made presentable. Closing this generator (Stop via cancel, a
    closed tab) closes the engine's, whose finally frees the decode slot and logs the reply."""
    updates = engine.chat(messages, settings, system_prompt=system_prompt or None,
                          thinking=thinking, stop=stop)
    try:
        yield from paced(updates)
    except Exception as error:  # input, busy, or a bug (logged): keep the server up
        raise user_error(client_error(error, context="reply").message) from error
    finally:
        stop.set()
        updates.close()


# Streamed updates per reply are at most one per this many seconds (the first and the last
# always go out); the ones in between are merged into the next that goes out, so nothing is
# lost. At 100+ tokens/s per reply one update per token would spend the server's time (and its
# Python lock, which the decode loop needs too) sending text faster than anyone reads it.
UPDATE_INTERVAL_S = 0.05


def paced(updates: Iterator[ChatUpdate]) -> Iterator[ChatUpdate]:
    last = pending = None
    for update in updates:
        pending = update if pending is None else pending.followed_by(update)
        now = time.monotonic()
        if update.done or last is None or now - last >= UPDATE_INTERVAL_S:
            last = now
            yield pending
            pending = None
    if pending is not None:  # the stream ended without a last update: what it had
        yield pending


class StopSignals:
    """The Stop button's link to the replies it should stop: session hash -> their Events.

    The Stop click and the streaming reply are separate events of one browser session, so the
    session hash is what they share; the Event itself is checked by the engine between decode
    steps.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._events: dict[str, set[threading.Event]] = defaultdict(set)

    def start(self, session: str | None) -> threading.Event:
        event = threading.Event()
        with self._lock:
            self._events[session or ""].add(event)
        return event

    def finish(self, session: str | None, event: threading.Event) -> None:
        with self._lock:
            events = self._events.get(session or "")
            if events is not None:
                events.discard(event)
                if not events:
                    del self._events[session or ""]

    def running(self, session: str | None) -> bool:
        """Whether a reply of this session is streaming now."""
        with self._lock:
            return bool(self._events.get(session or ""))

    def stop(self, session: str | None) -> int:
        with self._lock:
            events = list(self._events.get(session or "", ()))
        for event in events:
            event.set()
        return len(events)
