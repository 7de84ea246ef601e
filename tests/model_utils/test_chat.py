"""Messages -> prompt: the model's own template, thinking on/off, reasoning split, trimming."""

from __future__ import annotations

import json
import random

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from model_utils.chat.prompt import normalize_messages, prepare_prompt, render_prompt
from model_utils.chat.reasoning import (
    THINK_CLOSE,
    THINK_OPEN,
    ReasoningSplitter,
    ReplyText,
    SeparatedReasoning,
    prompt_opens_thinking,
    split_reasoning,
)
from model_utils.errors import ChatInputError
from model_utils.runtime.generation import IncrementalDetokenizer
from model_utils.runtime.generation_settings import GenerationSettings

from .helpers import FIXTURES, copy_demo, cpu_request

TEMPLATE_FILE = FIXTURES / "qwen3-chat-template.jinja"  # Qwen3's published template

CONVERSATIONS = {
    "one user turn": [{"role": "user", "content": "What is the capital of France?"}],
    "system prompt": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Explain why the sky is blue."},
    ],
    "multi-turn": [
        {"role": "system", "content": "Answer in one sentence."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Write a short poem about the sea."},
        {"role": "assistant", "content": "Waves fold the light."},
        {"role": "user", "content": "Another, please."},
    ],
    # Earlier assistant turns with their reasoning in the content: the template drops it.
    "reasoning as <think> in content": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"},
        {"role": "user", "content": "And 3+3?"},
    ],
    "reasoning as reasoning_content": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
        {"role": "user", "content": "And 3+3?"},
    ],
    # After the last user query (a tool round trip) the template keeps the assistant's
    # reasoning: both spellings of it must reach the prompt.
    "tool turn after reasoning_content": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "Use the tool."},
        {"role": "tool", "content": "{\"temp_c\": 21}"},
    ],
    "tool turn after <think> content": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "<think>\nUse the tool.\n</think>\n\nLet me look."},
        {"role": "tool", "content": "{\"temp_c\": 21}"},
    ],
    "unicode and markup": [
        {"role": "user", "content": "Übersetze: «naïve café» — {{ not jinja }} <b>bold</b>"},
    ],
}


def render_reference(messages: list[dict], *, thinking: bool) -> str:
    """The template file rendered by jinja2 directly, set up the way transformers sets it up."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    template = env.from_string(TEMPLATE_FILE.read_text())
    return template.render(messages=messages, add_generation_prompt=True,
                           enable_thinking=thinking)


@pytest.fixture
def qwen3_tokenizer(demo_tokenizer):
    demo_tokenizer.chat_template = TEMPLATE_FILE.read_text()
    return demo_tokenizer


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
@pytest.mark.parametrize("name", CONVERSATIONS)
def test_prompt_is_the_template_rendered_directly(qwen3_tokenizer, name, thinking):
    messages = CONVERSATIONS[name]
    expected = render_reference(messages, thinking=thinking)
    assert render_prompt(qwen3_tokenizer, messages, thinking=thinking) == expected
    # The chat path (prepare_prompt, what Engine.chat feeds the model) renders the same text.
    prepared = prepare_prompt(qwen3_tokenizer, messages, context_tokens=4096, reserve_tokens=64,
                              thinking=thinking)
    assert prepared.text == expected and prepared.dropped_messages == 0
    assert prepared.input_ids == qwen3_tokenizer(expected, add_special_tokens=False)["input_ids"]


def test_template_details_that_matter(qwen3_tokenizer):
    off = render_prompt(qwen3_tokenizer, CONVERSATIONS["one user turn"], thinking=False)
    on = render_prompt(qwen3_tokenizer, CONVERSATIONS["one user turn"], thinking=True)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n")
    # Reasoning of an earlier turn is dropped before the last user query, kept after it.
    assert "Add them" not in render_prompt(qwen3_tokenizer,
                                           CONVERSATIONS["reasoning as reasoning_content"])
    kept = render_prompt(qwen3_tokenizer, CONVERSATIONS["tool turn after reasoning_content"])
    assert "<think>\nUse the tool.\n</think>\n\nLet me look." in kept


def test_system_prompt_argument_replaces_the_system_message(qwen3_tokenizer):
    messages = CONVERSATIONS["system prompt"]
    expected = render_reference([{"role": "system", "content": "Be kind."}, messages[1]],
                                thinking=True)
    assert render_prompt(qwen3_tokenizer, messages, system_prompt="Be kind.") == expected
    assert render_prompt(qwen3_tokenizer, messages[1:], system_prompt="Be kind.") == expected


def test_demo_model_ships_the_qwen3_template(demo_tokenizer):
    assert demo_tokenizer.chat_template == TEMPLATE_FILE.read_text()


def test_content_parts_are_joined_and_roles_checked():
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]}]
    assert normalize_messages(parts) == [{"role": "user", "content": "ab"}]
    with pytest.raises(ChatInputError, match="unknown role 'robot'"):
        normalize_messages([{"role": "robot", "content": "x"}])
    with pytest.raises(ChatInputError, match="not an object"):
        normalize_messages(["hello"])


def test_conversation_must_end_with_a_user_turn(demo_tokenizer):
    with pytest.raises(ChatInputError, match="must end with a user message"):
        render_prompt(demo_tokenizer, [{"role": "user", "content": "hi"},
                                       {"role": "assistant", "content": "hello"}])
    with pytest.raises(ChatInputError, match="must end with a user message"):
        render_prompt(demo_tokenizer, [])


# -- no chat template -------------------------------------------------------------------------
def test_tokenizer_without_template_gives_a_clear_error(demo_tokenizer):
    demo_tokenizer.chat_template = None
    with pytest.raises(ChatInputError, match="no chat template"):
        render_prompt(demo_tokenizer, CONVERSATIONS["one user turn"])


def test_model_without_template_is_refused_by_chat(tmp_path, demo_path):
    from model_utils.engine import Engine

    folder = copy_demo(demo_path, tmp_path / "base-model")
    (folder / "chat_template.jinja").unlink()  # transformers 5 keeps the template here
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    engine = Engine(models_dir=tmp_path)
    engine.load(cpu_request("fp32", model="base-model"))
    assert not engine.supports_thinking()
    with pytest.raises(ChatInputError, match="no chat template.*instruct"):
        next(engine.chat(CONVERSATIONS["one user turn"]))
    assert engine.status()["loaded"]


# -- trimming the history to the context window -----------------------------------------------
def _long_history(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"Question {i}: " + "please explain " * 12})
        messages.append({"role": "assistant", "content": f"Answer {i}: " + "the sky is blue " * 12})
    messages.append({"role": "user", "content": "Final question: what is the capital of France?"})
    return messages


def test_long_history_keeps_the_newest_turns_with_a_notice(load_demo):
    engine = load_demo("fp32", context_tokens=256)
    messages = _long_history(turns=12)
    settings = GenerationSettings(max_new_tokens=16, min_new_tokens=16, temperature=0.0)
    updates = list(engine.chat(messages, settings))
    final = updates[-1]
    assert final.done and final.stats.new_tokens == 16
    assert "oldest" in final.notice and "left out" in final.notice
    assert final.stats.prompt_tokens + 16 <= 256

    loaded = engine.manager.loaded
    prepared = prepare_prompt(loaded.tokenizer, messages, context_tokens=256, reserve_tokens=16)
    assert prepared.dropped_messages > 0 and str(prepared.dropped_messages) in final.notice
    assert len(prepared.input_ids) == final.stats.prompt_tokens
    assert prepared.text.startswith("<|im_start|>system\nYou are a helpful assistant.")
    assert prepared.text.endswith("what is the capital of France?<|im_end|>\n"
                                  "<|im_start|>assistant\n")
    assert "Question 0:" not in prepared.text and "Answer 11:" in prepared.text
    # What is kept is a suffix of the conversation that starts with a user turn.
    kept = messages[1 + prepared.dropped_messages:]
    assert kept[0]["role"] == "user"
    assert prepared.text == render_prompt(loaded.tokenizer, [messages[0], *kept])


def test_single_overlong_message_is_refused_not_crashed(load_demo):
    engine = load_demo("fp32", context_tokens=256)
    huge = [{"role": "user", "content": "please explain the sea " * 200}]
    with pytest.raises(ChatInputError,
                       match=r"is \d+ tokens long and leaves no room .* window of 256 tokens"):
        next(engine.chat(huge, GenerationSettings(max_new_tokens=16)))
    # The model is untouched and answers the next, reasonable message.
    reply = engine.generate_text([{"role": "user", "content": "hi"}],
                                 GenerationSettings(max_new_tokens=2, min_new_tokens=2))
    assert reply.stats.new_tokens == 2 and not reply.notice


# -- reasoning / answer split -------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("<think>\nAdd them.\n</think>\n\n4", ("Add them.", "4")),
    ("<think>\n\n</think>\n\nHello", ("", "Hello")),  # thinking off: empty block
    ("Just an answer.", ("", "Just an answer.")),
    ("", ("", "")),
    ("<think>", ("", "")),  # streaming: the block has just opened
    ("<think>\nStep one", ("Step one", "")),  # streaming: reasoning so far
    ("<think>\nStep one\n</think>", ("Step one", "")),  # closed, no answer yet
    ("\n<think>\nx\n</think>\n\ny", ("x", "y")),
    ("<think>\nx\n</think>\n\nline 1\n\nline 2\n", ("x", "line 1\n\nline 2\n")),
])
def test_split_reasoning(text, expected):
    assert split_reasoning(text) == expected


def _split_stream(pieces: list[str], *, opened: bool = False):
    """Feed `pieces` to a ReasoningSplitter: (the deltas, (reasoning, answer) joined)."""
    splitter, text = ReasoningSplitter(opened=opened), ReplyText()
    deltas = [splitter.feed(piece) for piece in pieces] + [splitter.finish()]
    for delta in deltas:
        joined = text.add(delta)
    return deltas, (joined.reasoning, joined.answer)


def _pieces(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def test_split_reasoning_while_streaming_token_by_token(demo_tokenizer):
    """Fed a reply one token at a time (as the engine does), the split comes as deltas: the
    reasoning's, then the answer's, and joined they are the split of the whole text."""
    reply = "<think>\nFirst, we consider the question.\nThen we answer it.\n</think>\n\n" \
            "Paris is the capital of France."
    ids = demo_tokenizer(reply, add_special_tokens=False)["input_ids"]
    assert demo_tokenizer.convert_tokens_to_ids("</think>") in ids  # one token, as in Qwen3
    detok = IncrementalDetokenizer(demo_tokenizer)
    pieces = [detok.push(token) for token in ids]
    assert "".join(pieces) == reply
    deltas, joined = _split_stream(pieces)
    assert joined == split_reasoning(reply) == (
        "First, we consider the question.\nThen we answer it.", "Paris is the capital of France.")
    first_answer = next(i for i, d in enumerate(deltas) if d.answer)
    assert all(not d.answer for d in deltas[:first_answer])
    assert all(not d.reasoning and not d.resplit for d in deltas[first_answer:])


@pytest.mark.parametrize("pieces", [
    ["<thi", "nk>\nStep", " one\n</th", "ink>\n\nFour"],  # both tags split over pieces
    ["<", "t", "h", "i", "n", "k", ">", "\n", "x", "\n", "\n", "<", "/", "think", ">", "\n",
     "y"],
    ["\n  <think>", "\n\nA\n\nB\n\n", "\n</think>", "\n", "\n", "C\n"],
    ["<think>\nA </thinking> is not the tag</", "think>B"],  # a near-tag is text
], ids=["tags-split", "one-char-pieces", "newlines-around", "near-tag"])
def test_streamed_split_of_a_reply_that_opens_with_the_think_block(pieces):
    whole = "".join(pieces)
    deltas, joined = _split_stream(pieces)
    assert joined == split_reasoning(whole)
    assert joined[0] and joined[1]
    assert not any(d.resplit for d in deltas)
    # Nothing of a tag is ever shown, nor the newlines the split drops.
    assert not any("<" in d.answer or "think>" in d.reasoning for d in deltas)


@pytest.mark.parametrize("pieces", [
    ["Plain", " answer", " with\n\nlines\n"],
    ["  a < b", " and <thin", "g>"],  # starts like a tag, is not one
    ["<thi"],  # the reply ended there
    ["\n", " "],
    [],
], ids=["plain", "not-a-tag", "cut-in-tag", "blank", "empty"])
def test_streamed_split_of_a_reply_without_tags_is_all_answer(pieces):
    whole = "".join(pieces)
    deltas, joined = _split_stream(pieces)
    assert joined == split_reasoning(whole) == ("", whole)
    assert not any(d.reasoning for d in deltas)


@pytest.mark.parametrize("pieces", [
    ["First I check", " the units.\n", "</think>\n\n", "It is 4 m."],
    ["\nStep one", "\n</thi", "nk>", "\n", "\nDone"],
    ["Still thinking", " when it ended\n"],  # cut off before </think>
], ids=["closed", "tag-split", "unclosed"])
def test_streamed_split_when_the_template_opened_the_block(pieces):
    """Qwen3's thinking models' templates end the prompt with "<think>\n": the reply is the
    reasoning from its first token, and only </think> shows."""
    whole = "".join(pieces)
    deltas, joined = _split_stream(pieces, opened=True)
    assert joined == split_reasoning(THINK_OPEN + whole)
    if THINK_CLOSE in whole:
        assert joined == split_reasoning(whole)  # the same as without the opening tag
    else:
        assert joined == (whole.lstrip("\n"), "")
    assert not any(d.resplit for d in deltas)


def test_whether_the_prompt_opened_the_block(demo_tokenizer):
    messages = [{"role": "user", "content": "What does <think> mean?"}]
    assert not prompt_opens_thinking(render_prompt(demo_tokenizer, messages))
    off = render_prompt(demo_tokenizer, messages, thinking=False)
    assert off.rstrip().endswith(THINK_CLOSE) and not prompt_opens_thinking(off)
    # A template that writes the opening tag itself (as Qwen3's thinking-only models' do).
    demo_tokenizer.chat_template += "{%- if add_generation_prompt %}<think>\n{%- endif %}"
    assert prompt_opens_thinking(render_prompt(demo_tokenizer, messages))


def test_a_close_tag_after_untagged_text_resplits_once():
    """</think> after text that was shown as the answer (a template that opened the block
    where the split could not see it, a remote server's): split_reasoning reads the text
    before it as reasoning, and so does the stream, with one delta that says so."""
    pieces = ["abc", " def\n</thi", "nk>\n\nghi", " jkl</think>x"]
    deltas, joined = _split_stream(pieces)
    # (a further </think> closes nothing: it is not part of the answer)
    assert joined == split_reasoning("".join(pieces)) == ("abc def", "ghi jklx")
    assert [d.resplit for d in deltas] == [False, False, True, False, False]
    assert deltas[2].reasoning == "abc def" and deltas[2].answer == "ghi"


@pytest.mark.parametrize("events", [
    [("\n", ""), ("Think", ""), ("ing.\n\n", ""), ("", "\n\nHel"), ("", "lo.\n")],
    [("", "<think>\nHm"), ("", "m.\n</think>\n\n"), ("", "Hi.")],  # left in the content
    [("", "Plain "), ("", "answer")],
])
def test_a_servers_separate_reasoning_is_trimmed_as_the_split_trims(events):
    """vLLM's reasoning_content beside content: the reasoning without its surrounding
    newlines, the answer without leading ones; a server that leaves <think> in the content
    is split as the engine's own replies are."""
    split, text = SeparatedReasoning(), ReplyText()
    for reasoning, content in events:
        joined = text.add(split.feed(reasoning, content))
    joined = text.add(split.finish())
    reasoning = "".join(r for r, _ in events)
    content = "".join(c for _, c in events)
    expected = (reasoning.strip("\n"), content.lstrip("\n")) if reasoning \
        else split_reasoning(content)
    assert (joined.reasoning, joined.answer) == expected


def test_streamed_split_equals_the_whole_split_for_any_cuts():
    """Random replies made of tags, parts of tags, newlines and words, cut anywhere."""
    rng = random.Random(15)
    atoms = ["<think>", "</think>", "\n", "\n\n", " ", "a", "bc", "<", "</", "think", ">"]
    for _ in range(3000):
        whole = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 9)))
        cuts = sorted(rng.sample(range(1, len(whole)), min(rng.randint(0, 6),
                                                            max(len(whole) - 1, 0))))
        opened = rng.random() < 0.3
        _, joined = _split_stream(_pieces(whole, cuts), opened=opened)
        assert joined == split_reasoning((THINK_OPEN if opened else "") + whole), \
            (whole, cuts, opened)


def test_the_splitter_looks_only_at_the_new_piece():
    """Per piece the splitter examines the piece and the few characters it held back (a
    tag's beginning), however long the reply already is: a 20 000-piece reply costs each
    piece the same."""
    pieces = ["\n"] * 5_000 + ["<th", "ink>", "\n"] + ["so we reason\n"] * 10_000 + \
        ["</think>", "\n\n"] + ["and answer. "] * 10_000
    splitter, scanned = ReasoningSplitter(), []
    for piece in pieces:
        splitter.feed(piece)
        scanned.append(splitter.scanned - len(piece))
    assert max(scanned) <= len(THINK_CLOSE)
    splitter = ReasoningSplitter()  # no tags: each piece is searched with a tag's length
    for piece in [" "] * 5_000 + ["plain answer, "] * 10_000:
        splitter.feed(piece)
        assert splitter.scanned - len(piece) <= len(THINK_CLOSE)


def _trim_by_dropping_one_at_a_time(tokenizer, messages, *, context_tokens, reserve_tokens):
    """The reference: drop the oldest turn (then any that would lead without a user turn) and
    render again, until it fits: what prepare_prompt computes, the slow way."""
    system, turns = messages[:1], messages[1:]
    dropped = 0
    while True:
        text = render_prompt(tokenizer, system + turns)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= context_tokens - reserve_tokens or len(turns) <= 1:
            return dropped, ids
        turns, dropped = turns[1:], dropped + 1
        while len(turns) > 1 and turns[0]["role"] != "user":
            turns, dropped = turns[1:], dropped + 1


@pytest.mark.parametrize("context_tokens", [200, 256, 300, 512, 1024, 3000])
def test_trimming_finds_the_same_cut_as_dropping_one_turn_at_a_time(demo_tokenizer,
                                                                    context_tokens):
    messages = _long_history(turns=30)
    # Turns of uneven lengths, so that a per-turn estimate is off and must be corrected.
    for i, message in enumerate(messages[1:], 1):
        message["content"] += " more words" * (i * 7 % 23)
    messages.insert(5, {"role": "user", "content": "two user turns in a row"})
    expected_dropped, expected_ids = _trim_by_dropping_one_at_a_time(
        demo_tokenizer, messages, context_tokens=context_tokens, reserve_tokens=16)
    prepared = prepare_prompt(demo_tokenizer, messages, context_tokens=context_tokens,
                              reserve_tokens=16)
    assert prepared.dropped_messages == expected_dropped
    assert prepared.input_ids == expected_ids


def test_a_maximal_history_is_prepared_in_bounded_time(demo_tokenizer):
    """CPU cost guard: the largest history accepted (MAX_MESSAGES tiny turns) is prepared in
    well under STATED_BOUND_S on this machine's 2 shared cores (dropping one turn per render
    took 25 s), and one over the bounds is refused before any tokenizing."""
    import time

    from model_utils.chat.prompt import MAX_MESSAGES, MAX_PROMPT_CHARS

    stated_bound_s = 3.0
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"hi {i}"}
                for i in range(MAX_MESSAGES - 1)]
    start = time.process_time()
    prepared = prepare_prompt(demo_tokenizer, messages, context_tokens=4096, reserve_tokens=512)
    cpu_s = time.process_time() - start
    assert prepared.dropped_messages > 1000 and len(prepared.input_ids) <= 4096 - 512
    assert cpu_s < stated_bound_s, f"{cpu_s:.2f} s of CPU"
    with pytest.raises(ChatInputError, match=f"has {MAX_MESSAGES + 1} messages; at most"):
        prepare_prompt(demo_tokenizer, [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1),
                       context_tokens=4096, reserve_tokens=512)
    with pytest.raises(ChatInputError, match="characters long; at most"):
        prepare_prompt(demo_tokenizer, [{"role": "user", "content": "x" * (MAX_PROMPT_CHARS + 1)}],
                       context_tokens=4096, reserve_tokens=512)


def test_a_reply_longer_than_the_context_leaves_is_clamped_with_a_notice(load_demo):
    engine = load_demo("fp32", context_tokens=256)
    message = [{"role": "user", "content": "please explain the sea " * 25}]  # ~220 tokens
    reply = engine.generate_text(message, GenerationSettings(max_new_tokens=10**9,
                                                             min_new_tokens=10**9))
    prompt_tokens = reply.stats.prompt_tokens
    assert reply.stats.finish_reason == "length"
    assert reply.stats.new_tokens == 256 - prompt_tokens
    assert f"limited to {256 - prompt_tokens} tokens" in reply.notice
    assert "asked: 1000000000" in reply.notice
    # A reply that fits is not touched.
    reply = engine.generate_text(message, GenerationSettings(max_new_tokens=3, min_new_tokens=3))
    assert reply.stats.new_tokens == 3 and not reply.notice


@pytest.mark.parametrize("messages, system_prompt, says", [
    ([{"role": "user", "content": "hi"}], 123, "system prompt must be text, got a number"),
    ([{"role": "user", "content": "hi"}], ["x"], "system prompt must be text, got a list"),
    ([{"role": "user", "content": 42}], None, "message 0: content must be text, got a number"),
    ([{"role": "user", "content": {"a": 1}}], None, "message 0: part 0 must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], None,
     "only text parts"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], None, "part 0 must be"),
    ([{"role": 7, "content": "hi"}], None, "unknown role"),
    ([{"role": "user", "content": "bad \ud800 text"}], None, "lone UTF-16 surrogate"),
    ([{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}], None, "surrogate"),
    ([{"role": "user", "content": "hi"}], "sys \ud83d", "system prompt contains an invalid"),
    ({"role": "user", "content": "hi"}, None, "messages must be a list"),
    ("hello", None, "messages must be a list"),
])
def test_wrong_types_and_invalid_text_are_input_errors(load_demo, messages, system_prompt, says):
    engine = load_demo("fp32")
    with pytest.raises(ChatInputError) as caught:
        next(engine.chat(messages, GenerationSettings(max_new_tokens=2),
                         system_prompt=system_prompt))
    assert says in str(caught.value)
    with pytest.raises(ChatInputError):
        engine.render_prompt(messages, system_prompt=system_prompt)


def test_text_parts_are_accepted_as_openai_sends_them(demo_tokenizer):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is "},
                                          {"type": "text", "text": "the sea?"}]}]
    plain = [{"role": "user", "content": "What is the sea?"}]
    assert render_prompt(demo_tokenizer, parts) == render_prompt(demo_tokenizer, plain)


def test_the_engine_applies_the_bounds_on_its_own_path(load_demo):
    """engine.chat (what the page's Send, /chat and /v1 all call) refuses a 5000-turn
    conversation before tokenizing, and answers a maximal one with its oldest turns left out."""
    from model_utils.chat.prompt import MAX_MESSAGES

    engine = load_demo("fp32")
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"}
             for i in range(5001)]
    with pytest.raises(ChatInputError, match="has 5001 messages; at most"):
        next(engine.chat(turns, GenerationSettings(max_new_tokens=2)))
    reply = engine.generate_text(turns[:MAX_MESSAGES - 1],
                                 GenerationSettings(max_new_tokens=2, min_new_tokens=2))
    assert reply.stats.new_tokens == 2 and "left out of the prompt" in reply.notice


def test_stray_close_tags_after_the_reasoning_never_reach_the_answer():
    """A model that writes </think> again after its block closed (seen in multi-turn chats):
    those tags close nothing and are left out, streamed or whole."""
    text = "<think>\nwhy\n</think>\n\n</think> </think> </think> The Thinking switch"
    assert split_reasoning(text) == ("why", "The Thinking switch")
    deltas, joined = _split_stream(list(text))
    assert joined == ("why", "The Thinking switch")
