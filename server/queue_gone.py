"""A gradio client that closes its event stream mid-reply (gradio_client's /chat, a page's
tab) stops that reply at once, as the /v1 routes do (client_gone.py).

gradio itself notices such a client only when its stream next has a message to send, or
after its 10 s wait for one: a reply whose model server sends nothing (a trickled line, a
queue) held its place that long or longer. An ASGI middleware watches the event streams'
connections instead: the disconnect arrives the moment the client closes, and it sets the
stop event of every reply of that stream's session, which ends the reply within a decode step
(locally) or hangs up on the model server (--backend). The replies register their stop event
under their gr.Request's session hash, which is what the stream is named by:
GET .../queue/data?session_hash=H, or GET .../call/NAME/EVENT_ID for a client that sent none
(gradio names that event's session by its id).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import defaultdict
from collections.abc import Iterator
from urllib.parse import parse_qs

from starlette.middleware import Middleware


class QueueSessions:
    """Session hash -> the stop events of its replies streaming now."""

    def __init__(self):
        self._lock = threading.Lock()
        self._stops: dict[str, set[threading.Event]] = defaultdict(set)

    def add(self, session: str | None, stop: threading.Event) -> None:
        if session:  # None: not through gradio's queue, so no stream names it
            with self._lock:
                self._stops[session].add(stop)

    def discard(self, session: str | None, stop: threading.Event) -> None:
        with self._lock:
            stops = self._stops.get(session or "")
            if stops is not None:
                stops.discard(stop)
                if not stops:
                    del self._stops[session]

    @contextlib.contextmanager
    def watching(self, session: str | None, stop: threading.Event) -> Iterator[None]:
        self.add(session, stop)
        try:
            yield
        finally:
            self.discard(session, stop)

    def gone(self, session: str) -> int:
        with self._lock:
            stops = list(self._stops.get(session, ()))
        for stop in stops:
            stop.set()
        return len(stops)


SESSIONS = QueueSessions()  # one gradio app per process


def stream_session(scope) -> str | None:
    """The session whose event stream this request opens, or None for any other request."""
    if scope.get("type") != "http" or scope.get("method") != "GET":
        return None
    path = scope.get("path", "")
    if path.endswith("/gradio_api/queue/data"):
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        return (query.get("session_hash") or [None])[0]
    _, _, rest = path.partition("/gradio_api/call/")
    parts = rest.strip("/").split("/")
    if rest and len(parts) in (2, 3):  # NAME/EVENT_ID, or v2/NAME/EVENT_ID
        return parts[-1]
    return None


class QueueStreamWatch:
    def __init__(self, app, sessions: QueueSessions = SESSIONS):
        self.app, self.sessions = app, sessions

    async def __call__(self, scope, receive, send):
        session = stream_session(scope)
        if session is None:
            await self.app(scope, receive, send)
            return
        inbox: asyncio.Queue = asyncio.Queue()
        complete = False

        async def sent(message):
            nonlocal complete
            if message["type"] == "http.response.body" and not message.get("more_body"):
                complete = True  # from here a disconnect is the stream's normal end
            await send(message)

        async def pump():
            # The only reader of the connection; the app reads what it brings from the inbox.
            while True:
                message = await receive()
                inbox.put_nowait(message)
                if message["type"] == "http.disconnect":
                    if not complete:
                        self.sessions.gone(session)
                    return

        async def app_receive():
            message = await inbox.get()
            if message["type"] == "http.disconnect":
                inbox.put_nowait(message)  # said again to every later read, as a server does
            return message

        reader = asyncio.create_task(pump())
        try:
            await self.app(scope, app_receive, sent)
        finally:
            reader.cancel()


def queue_stream_watch() -> Middleware:
    """The watch as an entry of the FastAPI app's middleware list (see guards.request_guard)."""
    return Middleware(QueueStreamWatch)
