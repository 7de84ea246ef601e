"""The decode loop: settings validation, Stop within one step, greedy == model.generate."""

from __future__ import annotations

import threading

import pytest
import torch

from model_utils.chat.prompt import render_prompt
from model_utils.engine import eos_ids
from model_utils.errors import InvalidParameter
from model_utils.runtime.decoders import EagerDecoder
from model_utils.runtime.generation import IncrementalDetokenizer, decode_tokens
from model_utils.runtime.generation_settings import GenerationSettings
from model_utils.runtime.reply_stats import ReplyStats

from .helpers import HELLO


# -- settings -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name, value", [
    ("temperature", -1.0),
    ("temperature", float("nan")),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", -1),
    ("max_new_tokens", 0),
    ("repetition_penalty", 0.0),
    ("seed", -5),
])
def test_invalid_setting_is_refused_by_name(load_demo, name, value):
    engine = load_demo("fp32")
    assert engine.status()["context_tokens"] == 4096
    settings = GenerationSettings(**{name: value})
    with pytest.raises(InvalidParameter) as caught:
        next(engine.chat(HELLO, settings))
    assert caught.value.name == name
    assert str(caught.value).startswith(f"{name}: ")
    assert repr(value) in str(caught.value) or str(value) in str(caught.value)


def test_boundary_settings_are_accepted(load_demo):
    engine = load_demo("fp32")
    settings = GenerationSettings(max_new_tokens=1, temperature=0.0, top_p=1.0, top_k=0,
                                  repetition_penalty=1.0)
    assert engine.generate_text(HELLO, settings).stats.new_tokens <= 1


def test_unset_settings_come_from_generation_config(load_demo):
    engine = load_demo("fp32")
    defaults = engine.default_settings()
    config = engine.manager.loaded.model.generation_config  # Qwen3's published defaults
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (
        config.temperature, config.top_p, config.top_k)
    assert defaults.max_new_tokens == config.max_new_tokens


# -- stop ---------------------------------------------------------------------------------------
class CountingDecoder(EagerDecoder):
    """The eager decoder, counting forward passes (the loop is under test, not the decoder)."""

    steps = 0

    def step(self, token):
        self.steps += 1
        return super().step(token)


def _resolved(loaded, **values) -> GenerationSettings:
    """Settings as the engine hands them to decode_tokens: unset values filled in, checked."""
    return GenerationSettings(**values).resolved(loaded.model.generation_config,
                                                 context_tokens=loaded.context_tokens)


def _prompt_ids(loaded) -> list[int]:
    text = render_prompt(loaded.tokenizer, HELLO)
    return loaded.tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("stop_after", [1, 3, 10])
def test_stop_takes_effect_before_the_next_step(load_demo, stop_after):
    loaded = load_demo("fp32").manager.loaded
    decoder = CountingDecoder(loaded.model)
    settings = _resolved(loaded, max_new_tokens=64, min_new_tokens=64, temperature=0.0)
    stop, stats = threading.Event(), ReplyStats()
    received, after_stop = 0, 0
    for _token in decode_tokens(decoder, _prompt_ids(loaded), settings, eos_ids=eos_ids(loaded),
                                stop=stop, stats=stats):
        if stop.is_set():
            after_stop += 1
        received += 1
        if received == stop_after:
            stop.set()
    # Nothing is yielded once Stop is set, and no forward pass is run for a token that will
    # not be shown: N tokens took the prefill plus N - 1 steps.
    assert after_stop == 0
    assert received == stats.new_tokens == stop_after
    assert decoder.steps == stop_after - 1
    assert (stats.finish_reason, stats.stopped) == ("stop", True)


def test_stop_set_before_the_first_token(load_demo):
    loaded = load_demo("fp32").manager.loaded
    stop, stats = threading.Event(), ReplyStats()
    stop.set()
    tokens = list(decode_tokens(EagerDecoder(loaded.model), _prompt_ids(loaded),
                                _resolved(loaded, max_new_tokens=8, temperature=0.0),
                                eos_ids=eos_ids(loaded), stop=stop, stats=stats))
    assert tokens == [] and stats.new_tokens == 0 and stats.finish_reason == "stop"


def test_stop_through_the_engine(load_demo):
    """Through Engine.chat the decode runs on the worker thread and tokens already made are
    still delivered, so the exact count is checked on decode_tokens above; here: it stops."""
    engine = load_demo("fp32")
    settings = GenerationSettings(max_new_tokens=400, min_new_tokens=400, temperature=0.0)
    stop = threading.Event()
    updates = []
    for update in engine.chat(HELLO, settings, stop=stop):
        updates.append(update)
        if len(updates) == 2:
            stop.set()
    final = updates[-1]
    assert final.done and final.stats.finish_reason == "stop" and final.stats.stopped
    assert 2 <= final.stats.new_tokens < 400
    # The model serves the next reply normally.
    reply = engine.generate_text(HELLO, GenerationSettings(max_new_tokens=3, min_new_tokens=3))
    assert reply.stats.finish_reason == "length" and reply.stats.new_tokens == 3


def test_max_new_tokens_and_eos_end_the_reply(load_demo):
    loaded = load_demo("fp32").manager.loaded
    ids = _prompt_ids(loaded)
    stats = ReplyStats()
    tokens = list(decode_tokens(EagerDecoder(loaded.model), ids,
                                _resolved(loaded, max_new_tokens=5, temperature=0.0),
                                eos_ids=eos_ids(loaded), stats=stats))
    if stats.finish_reason == "length":
        assert len(tokens) == stats.new_tokens == 5
    else:  # the random model may say EOS first; EOS itself is not part of the reply
        assert stats.finish_reason == "eos" and len(tokens) == stats.new_tokens < 5
    assert not set(tokens) & eos_ids(loaded)
    assert stats.prompt_tokens == len(ids) and stats.ttft_ms > 0


# -- greedy equality with transformers ----------------------------------------------------------
PROMPTS = [
    [{"role": "user", "content": "Hello, how are you today?"}],
    [{"role": "system", "content": "Answer in one sentence."},
     {"role": "user", "content": "Explain why the sky is blue."}],
    [{"role": "user", "content": "def main():\n    print('hello world')"},
     {"role": "assistant", "content": "That prints hello world."},
     {"role": "user", "content": "Translate to German: The quick brown fox."}],
]


@pytest.mark.parametrize("prompt_index", range(len(PROMPTS)))
def test_greedy_decode_equals_model_generate(load_demo, prompt_index):
    loaded = load_demo("fp32").manager.loaded
    text = render_prompt(loaded.tokenizer, PROMPTS[prompt_index])
    ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    n = 24
    # EOS is masked for n tokens on both sides, so the sequences are compared at full length.
    ours = list(decode_tokens(EagerDecoder(loaded.model), ids,
                              _resolved(loaded, max_new_tokens=n, min_new_tokens=n,
                                        temperature=0.0, repetition_penalty=1.0),
                              eos_ids=eos_ids(loaded)))
    with torch.inference_mode():
        out = loaded.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n,
                                    min_new_tokens=n, repetition_penalty=1.0,
                                    attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    theirs = out[0, len(ids):].tolist()
    assert ours == theirs


def test_seeded_sampling_repeats(load_demo):
    engine = load_demo("fp32")
    settings = GenerationSettings(max_new_tokens=12, min_new_tokens=12, temperature=1.0,
                                  top_p=0.9, top_k=50, seed=7)
    first = engine.generate_text(HELLO, settings)
    second = engine.generate_text(HELLO, settings)
    assert (first.reasoning, first.answer) == (second.reasoning, second.answer)


# -- detokenizing a stream ----------------------------------------------------------------------
# Emoji, CJK and accents whose UTF-8 bytes are separate byte-level tokens in the demo vocabulary
# (checked below), with the chat markers, which skip_special_tokens leaves out.
SPANNING = "naïve café — 東京 😀 done <|im_end|>こんにちは ✨🎉<|im_start|> 👩‍💻 end"


def _ids(tokenizer, text=SPANNING) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _slow_route(tokenizer):
    """The demo tokenizer made to take the window route: a tokenizer whose decode cleans up
    spaces does more than DecodeStream does (BPE ignores the clean-up, so the text is the same)."""
    tokenizer.clean_up_tokenization_spaces = True
    return tokenizer


@pytest.mark.parametrize("route", ["DecodeStream", "window"])
def test_joined_deltas_are_the_decode_of_the_whole_reply(demo_tokenizer, route):
    tokenizer = demo_tokenizer if route == "DecodeStream" else _slow_route(demo_tokenizer)
    ids = _ids(tokenizer)
    chars = [c for c in SPANNING if ord(c) > 0x7F]
    assert len(ids) > len(SPANNING.split()) + len(chars)  # rare characters span tokens
    detok = IncrementalDetokenizer(tokenizer)
    assert (detok._stream is not None) == (route == "DecodeStream")
    pieces = [detok.push(token) for token in ids]
    assert "".join(pieces) + detok.flush() == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in piece for piece in pieces)  # never half a character
    assert "<|im_end|>" not in "".join(pieces)
    # A piece per completed character: the tokens of one emoji add nothing until its last.
    done = next(i for i in range(len(ids)) if "😀" in tokenizer.decode(ids[:i + 1]))
    assert pieces[done].endswith("😀") and pieces[done - 1] == pieces[done - 2] == ""


@pytest.mark.parametrize("route", ["DecodeStream", "window"])
def test_a_reply_cut_inside_a_character_ends_as_decode_ends_it(demo_tokenizer, route):
    tokenizer = demo_tokenizer if route == "DecodeStream" else _slow_route(demo_tokenizer)
    ids = _ids(tokenizer, "ok 😀")
    for cut in range(1, len(ids) + 1):  # max_new_tokens reached after each token in turn
        detok = IncrementalDetokenizer(tokenizer)
        text = "".join(detok.push(token) for token in ids[:cut])
        assert text + detok.flush() == tokenizer.decode(ids[:cut], skip_special_tokens=True)
        assert detok.flush() == ""  # flushed once


def test_the_window_route_decodes_a_bounded_window_per_token(demo_tokenizer):
    """The work per token does not grow with the reply: over a reply of some 3000 tokens, no
    step decodes more than a few tokens' worth (the window: the new tokens and the last
    piece's as context), and the total is linear in the reply."""
    tokenizer = _slow_route(demo_tokenizer)
    ids = _ids(tokenizer, SPANNING * 40)
    assert len(ids) > 2500
    detok = IncrementalDetokenizer(tokenizer)
    per_step = []
    for token in ids:
        before = detok.decoded_tokens
        detok.push(token)
        per_step.append(detok.decoded_tokens - before)
    assert max(per_step) <= 16  # a character is at most 4 byte tokens (ZWJ joins are apart)
    assert max(per_step[-100:]) <= max(per_step[:100])
    assert sum(per_step) <= 8 * len(ids)


# -- the engine's stream ------------------------------------------------------------------------
def _joined(updates) -> tuple[str, str]:
    """The reasoning and answer a consumer of the deltas alone ends up with."""
    reasoning, answer = "", ""
    for update in updates:
        if update.resplit:
            reasoning, answer = "", ""
        reasoning += update.reasoning_delta
        answer += update.answer_delta
    return reasoning, answer


def _reference_text(loaded, messages, max_new_tokens: int) -> str:
    """The greedy reply's text computed the plain way: decode_tokens, then one decode."""
    from model_utils.chat.prompt import prepare_prompt

    prompt = prepare_prompt(loaded.tokenizer, messages, context_tokens=loaded.context_tokens,
                            reserve_tokens=max_new_tokens, thinking=True)
    tokens = list(decode_tokens(EagerDecoder(loaded.model), prompt.input_ids,
                                _resolved(loaded, temperature=0.0,
                                          max_new_tokens=max_new_tokens),
                                eos_ids=eos_ids(loaded)))
    return loaded.tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.mark.parametrize("question", ["Which mode should I pick?", "What is nf4?"])
def test_the_engine_streams_deltas_of_its_reply(load_demo, question):
    """engine.chat yields what each token added; joined, the deltas are the split of the
    decode of the reply's tokens (computed here the plain way), and each update's full text
    is the deltas so far."""
    from model_utils.chat.reasoning import split_reasoning

    engine = load_demo("fp32")
    messages = [{"role": "user", "content": question}]
    updates = list(engine.chat(messages, GenerationSettings(temperature=0.0, max_new_tokens=80),
                               thinking=True))
    assert updates[-1].done and not any(u.done for u in updates[:-1])
    assert all(u.reasoning_delta or u.answer_delta for u in updates[:-1])
    for i in (0, len(updates) // 2, len(updates) - 1):
        assert (updates[i].reasoning, updates[i].answer) == _joined(updates[:i + 1])
    whole = _reference_text(engine.manager.loaded, messages, 80)
    assert _joined(updates) == split_reasoning(whole)
    assert question != "Which mode should I pick?" or updates[-1].reasoning  # it reasons


def test_a_reply_after_a_prompt_that_opened_the_block_streams_as_reasoning(load_demo):
    """A template that ends the prompt with "<think>\n" (Qwen3's thinking-only models): the
    engine splits the reply as reasoning from its first token, where a splitter that did not
    know would have shown it as the answer until </think> (and then split it again)."""
    from model_utils.chat.reasoning import ReasoningSplitter, split_reasoning

    engine = load_demo("fp32")
    loaded = engine.manager.loaded
    messages = [{"role": "user", "content": "Which mode should I pick?"}]
    template = loaded.tokenizer.chat_template
    loaded.tokenizer.chat_template = \
        template + "{%- if add_generation_prompt %}<think>\n{%- endif %}"
    try:
        updates = list(engine.chat(messages, GenerationSettings(temperature=0.0,
                                                                max_new_tokens=80)))
        whole = _reference_text(loaded, messages, 80)
    finally:
        loaded.tokenizer.chat_template = template
    assert "<think>" not in whole and "</think>" in whole  # the prompt opened the block
    assert updates[0].reasoning_delta and not updates[0].answer_delta
    assert not any(u.resplit for u in updates)
    assert _joined(updates) == split_reasoning(whole) == split_reasoning("<think>" + whole)
    unaware = ReasoningSplitter()
    assert unaware.feed(whole[:20]).answer  # what the prompt's tag changes
