"""A model server's reply read as bytes, with every size bounded: server-sent event lines split
here (httpx's iter_lines would buffer a line without a newline whole, however long), error and
/models bodies read only up to their cap, and strings made safe to send on (a lone surrogate
from a JSON escape would break this app's own UTF-8 event stream).

What is read past a cap is never kept: the connection is closed instead.
"""

from __future__ import annotations

import json
import re
import time

import httpx

from .errors import MalformedStream

# One event's JSON (a "data:" line's payload). A token's event is ~300 bytes, one with 20
# logprob alternatives a few KB, a whole tool call's arguments at once some KB more.
MAX_EVENT_BYTES = 1 << 20
# Any one line of the event stream (a comment too), newline or not.
MAX_LINE_BYTES = 2 << 20
# What is read of an error reply: enough for its message.
MAX_ERROR_BODY_BYTES = 8192
# The /models answer: thousands of models' entries fit.
MAX_MODELS_BODY_BYTES = 1 << 20

_SURROGATE = re.compile("[\ud800-\udfff]")


class LineSplitter:
    """Bytes in, complete lines out (without their "\\n" or "\\r\\n"); a line longer than
    MAX_LINE_BYTES, newline or not, is a MalformedStream and nothing of it is kept."""

    def __init__(self, limit: int = MAX_LINE_BYTES):
        self.limit = limit
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        lines, start = [], 0
        while (end := self._buffer.find(b"\n", start)) >= 0:
            line = bytes(self._buffer[start:end]).removesuffix(b"\r")
            start = end + 1
            if len(line) > self.limit:
                self._too_long()
            lines.append(line)
        del self._buffer[:start]
        if len(self._buffer) > self.limit:
            self._too_long()
        return lines

    def rest(self) -> bytes:
        """What followed the last newline when the stream ended."""
        rest, self._buffer = bytes(self._buffer), bytearray()
        return rest

    def _too_long(self) -> None:
        self._buffer = bytearray()  # let go of it now, not when the reply ends
        raise MalformedStream(f"the model server sent a line of more than "
                              f"{self.limit // 1024} KB in its reply (at most "
                              f"{self.limit // 1024} KB is read): the reply was cut there")


def check_identity(response: httpx.Response) -> None:
    """Bodies are read raw and bounded in bytes; a compressed one would be bounded only after
    it was inflated, so it is refused (this app asks for none: Accept-Encoding: identity)."""
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise MalformedStream(f"the model server compressed its answer "
                              f"({encoding[:30]}) although this app asked it not to")


def read_capped(response: httpx.Response, limit: int, *, what: str,
                deadline: float | None = None) -> bytes:
    """The body up to `limit` bytes, by `deadline` (time.monotonic()); past either,
    MalformedStream (the rest is not read)."""
    check_identity(response)
    out = bytearray()
    for piece in response.iter_raw():
        out += piece
        if len(out) > limit:
            raise MalformedStream(f"the model server's {what} is larger than "
                                  f"{limit // 1024} KB: not read")
        if deadline is not None and time.monotonic() > deadline:
            raise MalformedStream(f"the model server's {what} came too slowly: not read")
    return bytes(out)


def read_head(response: httpx.Response, limit: int = MAX_ERROR_BODY_BYTES) -> bytes:
    """The start of an error body, without reading the rest of a huge one."""
    out = bytearray()
    for piece in response.iter_raw():
        out += piece
        if len(out) >= limit:
            break
    return bytes(out[:limit])


def parse_event(data: str) -> dict:
    """One event's JSON object, its strings made safe to send on."""
    if len(data) > MAX_EVENT_BYTES:
        raise MalformedStream(f"the model server sent an event larger than "
                              f"{MAX_EVENT_BYTES // 1024} KB: the reply was cut there")
    try:
        event = json.loads(data)
    except ValueError:
        raise MalformedStream("the model server sent an event that is not JSON") from None
    if not isinstance(event, dict):
        raise MalformedStream("the model server sent an event that is not a JSON object")
    if "\\u" in data:  # only an escape can carry a lone surrogate into the parsed text
        event = without_surrogates(event)
    return event


def without_surrogates(value):
    """Lone surrogates (from "\\ud800" escapes) replaced by U+FFFD, anywhere in a JSON value:
    they cannot be encoded as UTF-8, so sending them on would break the client's stream."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {without_surrogates(k): without_surrogates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_surrogates(v) for v in value]
    return value
