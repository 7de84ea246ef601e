"""The context budget of a conversation (model_utils/chat/budget.py): the count a reply's
prompt will have, the turns it would leave out, and the estimate used without a tokenizer."""

from __future__ import annotations

from model_utils.chat.budget import estimate_prompt, measure_prompt
from model_utils.runtime.generation_settings import GenerationSettings

from .test_chat import _long_history


def test_the_count_is_the_prompt_the_reply_gets_with_what_it_leaves_out(load_demo):
    engine = load_demo("fp32", context_tokens=256)
    messages = _long_history(turns=12)
    settings = GenerationSettings(max_new_tokens=16, min_new_tokens=16, temperature=0.0)
    budget = engine.count_prompt(messages, settings)
    assert budget.context_tokens == 256 and budget.reply_tokens == 16
    assert budget.dropped_messages > 0 and not budget.estimated and not budget.error
    final = list(engine.chat(messages, settings))[-1]
    assert budget.prompt_tokens == final.stats.prompt_tokens
    assert f"oldest {budget.dropped_messages} message(s)" in final.notice

    short = engine.count_prompt(messages[-1:], settings)
    assert short.dropped_messages == 0 and short.prompt_tokens < budget.prompt_tokens
    assert not short.near_limit


def test_a_message_with_no_room_left_comes_back_as_the_error_a_reply_would_get(demo_tokenizer):
    settings = GenerationSettings(max_new_tokens=16)
    budget = measure_prompt(demo_tokenizer, [{"role": "user", "content": "word " * 400}],
                            settings, context_tokens=256, system_prompt=None, thinking=True)
    assert "leaves no room for a reply" in budget.error and budget.prompt_tokens == 0
    # An open-ended reply (max_new_tokens = the window) keeps at most half of it.
    open_ended = measure_prompt(demo_tokenizer, [{"role": "user", "content": "hi"}],
                                GenerationSettings(max_new_tokens=256), context_tokens=256,
                                system_prompt=None, thinking=True)
    assert open_ended.reply_tokens == 128


def test_the_estimate_says_it_is_one_and_warns_near_the_window():
    messages = [{"role": "user", "content": "x" * 400}]
    budget = estimate_prompt(messages, GenerationSettings(max_new_tokens=64),
                             context_tokens=180, system_prompt="Be brief.")
    assert budget.estimated and budget.prompt_tokens == 100 + 3 + 2 * 4
    assert budget.near_limit and budget.dropped_messages == 0
    unknown = estimate_prompt(messages, GenerationSettings(), context_tokens=None,
                              system_prompt=None)
    assert unknown.context_tokens is None and not unknown.near_limit
    bad = estimate_prompt([{"role": "robot"}], GenerationSettings(), context_tokens=None,
                          system_prompt=None)
    assert "unknown role" in bad.error
