"""Tool calls in a reply's answer: the `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
blocks Qwen2.5, Qwen3 and Hermes-style templates teach the model (several may follow each
other), apart from the text around them; whole (parse_tool_calls) or as the answer streams
(ToolCallFollower). A block that is not such JSON stays in the text, as vLLM's Hermes parser
leaves it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def read_call(body: str) -> ToolCall | None:
    """The JSON between the tags -> a call, or None when it is not {"name": str, "arguments":
    an object (or JSON text of one)}."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(data["name"], json.dumps(arguments, ensure_ascii=False))


def parse_tool_calls(answer: str) -> tuple[str, list[ToolCall]]:
    """A whole answer -> (its text without the calls, stripped; the calls in order)."""
    follower = ToolCallFollower()
    text, calls = follower.feed(answer)
    rest, more = follower.finish()
    return text + rest, calls + more


class ToolCallFollower:
    """The answer as it streams: feed(piece) -> (text to show now, calls completed now). Text
    that may be the start of a block is held until it is clear; a block is held until its end
    tag, then given as a call (or as text, when it is not one)."""

    def __init__(self):
        self._held = ""  # text not given out yet: a possible or an open block
        self._space = ""  # blanks given out only when more text follows them
        self._started = False
        self.calls = 0

    def feed(self, piece: str) -> tuple[str, list[ToolCall]]:
        text, calls = self._feed(piece)
        return self._trimmed(text), calls

    def _trimmed(self, text: str) -> str:
        """The text with its blanks at the start of the answer, and those around the calls
        at its end, left out (the whole answer stripped, as it streams)."""
        if not self._started:
            text = text.lstrip()
            self._started = bool(text)
        body = text.rstrip()
        if not body:
            self._space += text
            return ""
        out = self._space + body
        self._space = text[len(body):]
        return out

    def _feed(self, piece: str) -> tuple[str, list[ToolCall]]:
        self._held += piece
        out, calls = [], []
        while self._held:
            start = self._held.find(TOOL_OPEN)
            if start < 0:
                keep = _partial_tag_at_end(self._held, TOOL_OPEN)
                out.append(self._held[:len(self._held) - keep])
                self._held = self._held[len(self._held) - keep:]
                break
            out.append(self._held[:start])
            self._held = self._held[start:]
            end = self._held.find(TOOL_CLOSE)
            if end < 0:
                break  # inside a block: wait for its end
            block = self._held[:end + len(TOOL_CLOSE)]
            self._held = self._held[end + len(TOOL_CLOSE):]
            call = read_call(block[len(TOOL_OPEN):-len(TOOL_CLOSE)])
            if call is None:
                out.append(block)
            else:
                calls.append(call)
        self.calls += len(calls)
        return "".join(out), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The end of the answer: what is still held is text (a block cut off by the length
        limit, say)."""
        held, self._held = self._held, ""
        text = self._trimmed(held)
        self._space = ""
        return text, []


def _partial_tag_at_end(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
