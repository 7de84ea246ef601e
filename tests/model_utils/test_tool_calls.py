"""Tool calls in a reply's answer (model_utils/chat/tool_calls.py): several in one turn, the
same whole and streamed piece by piece, blocks that are not calls left as text, and the grammar
of tool_choice "required": the calls and nothing else."""

from __future__ import annotations

import json

import pytest

from model_utils.chat.tool_calls import ToolCallFollower, parse_tool_calls
from model_utils.runtime.grammar import OutputFormat, structural_tag

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


def grammar_takes(fmt: OutputFormat, reasoning: str, text: str) -> bool:
    """Whether the reply grammar of `fmt` takes `text` as a whole reply (then the end of turn)."""
    import xgrammar as xgr

    grammar = xgr.Grammar.from_structural_tag(structural_tag(fmt, reasoning))
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False)\
        .compile_grammar(grammar)
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_2 = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
GRAMMAR_TOOLS = ({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
                 {"type": "function", "function": {"name": "get_time", "parameters": {
                     "type": "object", "properties": {}}}})


@pytest.mark.parametrize("reasoning, thought", [("disabled", ""), ("auto", ""),
                                                ("auto", "<think>\nPlan.\n</think>\n\n"),
                                                ("enabled", "Plan.\n</think>\n\n")])
def test_a_required_call_is_the_whole_reply_with_nothing_after_the_last_call(reasoning, thought):
    required = OutputFormat(tools=GRAMMAR_TOOLS, tool_choice="required")
    assert grammar_takes(required, reasoning, thought + CALL)
    assert grammar_takes(required, reasoning, thought + CALL + "\n" + CALL_2)
    # No text after the calls (a model went on up to the token limit), before them, or
    # instead of them.
    assert not grammar_takes(required, reasoning, thought + CALL + "\nThe weather is fine.")
    assert not grammar_takes(required, reasoning, thought + CALL + "\n")
    assert not grammar_takes(required, reasoning, thought + "Let me look. " + CALL)
    assert not grammar_takes(required, reasoning, thought + "It is sunny.")
    one = OutputFormat(tools=GRAMMAR_TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert grammar_takes(one, reasoning, thought + CALL)
    assert not grammar_takes(one, reasoning, thought + CALL + "\n" + CALL_2)
