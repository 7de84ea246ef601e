"""The OpenAI wire shapes the remote backend sends and reads beyond plain chat text: a message's
tool calls, an OutputFormat's tools and response format, streamed tool-call deltas (given back
as the <tool_call> blocks a local model writes) and streamed logprobs."""

from __future__ import annotations

import json

from model_utils.chat.tool_calls import TOOL_CLOSE, TOOL_OPEN
from model_utils.chat.updates import TokenLogprob
from model_utils.runtime.grammar import OutputFormat


def wire_message(message: dict) -> dict:
    """A normalised message as OpenAI's API takes it (earlier reasoning is not sent; a tool
    call's arguments are JSON text)."""
    out = {"role": message["role"], "content": message["content"]}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {"id": call.get("id") or f"call_{i}", "type": "function",
             "function": {"name": call["function"]["name"],
                          "arguments": call["function"]["arguments"]
                          if isinstance(call["function"]["arguments"], str)
                          else json.dumps(call["function"]["arguments"])}}
            for i, call in enumerate(message["tool_calls"])]
    if message["role"] == "tool" and message.get("tool_call_id"):
        out["tool_call_id"] = message["tool_call_id"]
    return out


def token_logprobs(logprobs) -> list[TokenLogprob]:
    """choices[].logprobs.content of a server's chunk -> TokenLogprobs (malformed: none)."""
    entries = logprobs.get("content") if isinstance(logprobs, dict) else None
    out = []
    for entry in entries if isinstance(entries, list) else ():
        try:
            top = tuple((str(t["token"]), float(t["logprob"]))
                        for t in entry.get("top_logprobs") or ())
            out.append(TokenLogprob(str(entry["token"]), float(entry["logprob"]), top))
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
    return out


def format_options(fmt: OutputFormat | None) -> dict:
    """An OutputFormat as the fields of OpenAI's request."""
    if fmt is None:
        return {}
    out = {}
    if fmt.tools:
        out["tools"] = list(fmt.tools)
        out["tool_choice"] = fmt.tool_choice
        out["parallel_tool_calls"] = fmt.parallel_tool_calls
    if fmt.response_format == "json_object":
        out["response_format"] = {"type": "json_object"}
    elif fmt.response_format == "json_schema":
        out["response_format"] = {"type": "json_schema",
                                  "json_schema": {"name": "response", "schema": fmt.schema}}
    return out


class StreamedCalls:
    """delta.tool_calls as a server streams them (an entry per call index: its name once,
    its arguments in pieces), given back as <tool_call> blocks once complete."""

    def __init__(self):
        self._calls: dict[int, dict] = {}

    @property
    def pending(self) -> bool:
        return bool(self._calls)

    def add(self, deltas) -> None:
        for delta in deltas or ():
            if not isinstance(delta, dict):
                continue
            entry = self._calls.setdefault(delta.get("index", len(self._calls)),
                                           {"name": "", "arguments": ""})
            function = delta.get("function") or {}
            entry["name"] += function.get("name") or ""
            entry["arguments"] += function.get("arguments") or ""

    def as_text(self) -> str:
        calls, self._calls = self._calls, {}
        blocks = []
        for index in sorted(calls):
            call = calls[index]
            try:
                arguments = json.loads(call["arguments"] or "{}")
            except ValueError:
                arguments = call["arguments"]
            blocks.append(f"{TOOL_OPEN}\n" + json.dumps({"name": call["name"],
                                                          "arguments": arguments}) +
                          f"\n{TOOL_CLOSE}")
        return "\n".join(blocks)
