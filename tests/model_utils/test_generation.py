"""The decode loop: settings validation, Stop within one step, greedy == model.generate."""

from __future__ import annotations

import threading

import pytest
import torch

from model_utils.chat.prompt import render_prompt
from model_utils.engine import eos_ids
from model_utils.runtime.decoders import EagerDecoder
from model_utils.runtime.generation import (
    GenerationSettings,
    IncrementalDetokenizer,
    InvalidParameter,
    ReplyStats,
    decode_tokens,
)

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
def test_incremental_detokenizer_never_splits_a_character(demo_tokenizer):
    text = "naïve café — 東京 😀 done"
    ids = demo_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text.split())  # bytes of the rare characters are separate tokens
    detok = IncrementalDetokenizer(demo_tokenizer)
    pieces = [detok.push(token) for token in ids]
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)
