"""Tools and structured output on the OpenAI-compatible endpoint: the request's `tools`,
`tool_choice` and `response_format` as the engine's OutputFormat, and the reply's tool calls
as OpenAI returns them (message.tool_calls, or delta.tool_calls chunks when streamed).

tool_choice "auto" (the default with tools) lets the model answer or call; "required" and a
named function are guaranteed by constrained decoding (model_utils/runtime/grammar.py), as is
a response_format of json_object or json_schema. "none" leaves the tools out of the prompt.
"""

from __future__ import annotations

from model_utils.chat.tool_calls import ToolCall, ToolCallFollower
from model_utils.runtime.grammar import OutputFormat

from .errors import ClientError
from .request_models import _ChatCompletionFields


def output_format(body: _ChatCompletionFields) -> OutputFormat | None:
    """The format the request asks for, None for free text without tools; a ClientError (400,
    naming the field) for a choice that cannot be met."""
    tools = tuple({"type": "function", "function": t.function.model_dump(exclude_none=True)}
                  for t in body.tools or ())
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise ClientError(400, "tools: two tools have the same name", param="tools")
    choice = body.tool_choice
    if choice is None:
        choice = "auto"
    elif not isinstance(choice, str):
        if choice.function.name not in names:
            raise ClientError(400, f"tool_choice: no tool is named {choice.function.name!r}",
                              param="tool_choice")
        choice = {"type": "function", "function": {"name": choice.function.name}}
    if choice == "required" and not tools:
        raise ClientError(400, 'tool_choice: "required" needs at least one tool',
                          param="tool_choice")
    response = body.response_format
    kind = response.type if response is not None and response.type != "text" else None
    schema = None
    if kind == "json_schema":
        if response.json_schema is None or response.json_schema.schema_ is None:
            raise ClientError(400, 'response_format: json_schema needs {"name": ..., "schema": '
                              "{...}}", param="response_format")
        schema = response.json_schema.schema_
    if kind is not None and tools and choice not in ("none", "auto"):
        raise ClientError(400, "response_format and a required tool call cannot both be "
                          "forced", param="response_format")
    if kind is None and not tools:
        return None
    return OutputFormat(response_format=kind, schema=schema, tools=tools, tool_choice=choice,
                        parallel_tool_calls=body.parallel_tool_calls is not False,
                        param="response_format" if kind else "tools")


class ToolCallStream:
    """The reply's answer with its tool calls taken out, as it streams (with tools only)."""

    def __init__(self, fmt: OutputFormat | None):
        self.active = bool(fmt and fmt.rendered_tools)
        self.follower = ToolCallFollower()
        self.calls: list[ToolCall] = []

    def feed(self, answer_delta: str, done: bool) -> tuple[str, list[ToolCall]]:
        """(text to show, calls completed) for one answer delta."""
        if not self.active:
            return answer_delta, []
        text, calls = self.follower.feed(answer_delta)
        if done:
            rest, more = self.follower.finish()
            text, calls = text + rest, calls + more
        self.calls += calls
        return text, calls


def call_deltas(calls: list[ToolCall], first_index: int) -> list[dict]:
    """delta.tool_calls entries: each call whole in one entry, as the openai package and
    langchain assemble them (index, id, type, name, then the arguments)."""
    return [{"index": first_index + i, **call.as_openai()} for i, call in enumerate(calls)]
