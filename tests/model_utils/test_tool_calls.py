"""Tool calls in a reply's answer (model_utils/chat/tool_calls.py): several in one turn, the
same whole and streamed piece by piece, and blocks that are not calls left as text."""

from __future__ import annotations

import json

import pytest

from model_utils.chat.tool_calls import ToolCallFollower, parse_tool_calls
from model_utils.runtime.grammar import OutputFormat

TWO_CALLS = ('Let me look both up.\n<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
             '"arguments": "{\\"zone\\": \\"CET\\"}"}\n</tool_call>\n')


def streamed(answer: str, size: int) -> tuple[str, list]:
    follower, text, calls = ToolCallFollower(), [], []
    for start in range(0, len(answer), size):
        shown, done = follower.feed(answer[start:start + size])
        text.append(shown)
        calls += done
    rest, _ = follower.finish()
    return "".join(text) + rest, calls


def test_two_calls_in_one_answer_come_back_in_order_with_the_text_apart():
    text, calls = parse_tool_calls(TWO_CALLS)
    assert text == "Let me look both up."
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    # arguments are JSON text of an object, also when the model wrote them as a string
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Paris"}, {"zone": "CET"}]
    assert calls[0].id != calls[1].id


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streamed_piece_by_piece_equals_the_whole_answer(size):
    whole_text, whole_calls = parse_tool_calls(TWO_CALLS)
    text, calls = streamed(TWO_CALLS, size)
    assert text == whole_text
    assert [(c.name, c.arguments) for c in calls] == \
        [(c.name, c.arguments) for c in whole_calls]


def test_a_block_that_is_not_a_call_stays_text_and_a_cut_off_one_is_given_at_the_end():
    text, calls = parse_tool_calls("a <tool_call>not json</tool_call> b")
    assert calls == [] and text == "a <tool_call>not json</tool_call> b"
    text, calls = streamed('fine <tool_call>{"name": "get_weather", "argu', 2)
    assert calls == [] and text == 'fine <tool_call>{"name": "get_weather", "argu'


def test_tool_choice_none_keeps_the_tools_out_of_the_prompt():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    assert OutputFormat(tools=tuple(tools)).rendered_tools == tools
    assert OutputFormat(tools=tuple(tools), tool_choice="none").rendered_tools is None
    assert not OutputFormat(tools=tuple(tools)).constrained  # "auto": the model may answer
    assert OutputFormat(tools=tuple(tools), tool_choice="required").constrained
