"""The conversation list and its views (pure functions: no app needed)."""

from __future__ import annotations

import json

import pytest

from server.conversation import (
    ConversationError,
    chatbot_messages,
    engine_messages,
    export_json,
    import_json,
    without_last_reply,
    without_last_turn,
)
from server.replies import make_settings, stats_line, waiting_notice

TURNS = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning": "two and two", "stats": "9 ms"},
    {"role": "user", "content": "3+3?"},
    {"role": "assistant", "content": "6"},
]


def test_engine_gets_answers_and_reasoning_but_never_the_stats_line():
    messages = engine_messages(TURNS)
    assert messages[1] == {"role": "assistant", "content": "4",
                           "reasoning_content": "two and two"}
    assert all("9 ms" not in m["content"] for m in messages)


def test_chatbot_draws_reasoning_as_a_thought_and_stats_under_the_answer():
    view = chatbot_messages(TURNS)
    thought = view[1]
    assert thought["metadata"] == {"title": "Reasoning", "status": "done"}
    assert view[2]["content"].startswith("4") and "<sub>9 ms</sub>" in view[2]["content"]
    streaming = chatbot_messages(TURNS[:1], {"content": "", "reasoning": "hmm"})
    assert streaming[-1]["metadata"]["status"] == "pending"  # still thinking: open, spinner


def test_undo_and_regenerate_cut_at_the_last_user_message():
    assert without_last_turn(TURNS) == (TURNS[:2], "3+3?")
    assert without_last_reply(TURNS) == (TURNS[:2], "3+3?")
    assert without_last_turn([]) == ([], "")
    assert without_last_reply([]) == ([], None)


def test_export_then_import_round_trips():
    turns, system_prompt = import_json(export_json(TURNS, "Be brief."))
    assert turns == TURNS and system_prompt == "Be brief."


def test_import_accepts_openai_style_lists():
    turns, system_prompt = import_json(json.dumps(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]))
    assert turns == [{"role": "user", "content": "U"}] and system_prompt == "S"


@pytest.mark.parametrize(("text", "expected"), [
    ("not json", "not a JSON file"),
    ('{"messages": 3}', "messages"),
    ('[{"role": "robot", "content": "x"}]', "role"),
    ('[{"role": "user", "content": 5}]', "content must be a string"),
    ('[{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]', "first"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply to read"),
    ('[{"role": "user", "content": "a", "n": ' + "9" * 5000 + "}]",
     r"a number too long to read \(over 4300 digits\)"),
    (json.dumps([{"role": "user", "content": "x" * 2_200_000}]),
     "the browser keeps at most 2 MB of it"),
])
def test_import_refuses_what_is_not_a_conversation(text, expected):
    with pytest.raises(ConversationError, match=expected):
        import_json(text)


def test_settings_from_sliders_and_json():
    settings = make_settings({"temperature": 0.5, "top_k": 40.0, "max_new_tokens": 64.0,
                              "seed": -1})
    assert settings.top_k == 40 and settings.max_new_tokens == 64 and settings.seed is None
    assert make_settings(None).temperature is None  # the model's default


def test_stats_line_says_when_a_reply_was_cut():
    from model_utils.runtime.reply_stats import ReplyStats

    stopped = ReplyStats(prompt_tokens=3, new_tokens=5, stopped=True, finish_reason="stop")
    assert stats_line(stopped, "nf4").endswith("· nf4 · stopped")
    full = ReplyStats(new_tokens=5, finish_reason="length")
    assert "hit max_new_tokens" in stats_line(full, "bf16")
    assert "while reasoning: no answer yet" in stats_line(full, "bf16", no_answer=True)


def test_a_reply_sent_during_the_idle_compile_is_told_why_it_waits():
    assert waiting_notice({"mode": "bf16"}) == ""
    notice = waiting_notice({"mode": "bf16", "compiling_for_s": 12.4})
    assert "compiling" in notice and "started 12 s ago" in notice
