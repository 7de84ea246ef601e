"""Constrained decoding on the CPU with the demo model: a reply forced into a JSON schema or a
tool call follows it token for token, whether it decodes alone (the single-stream decoder) or
beside free replies in a batch, and the free replies are exactly what they are alone."""

from __future__ import annotations

import json
import re

import pytest

from model_utils.chat.tool_calls import parse_tool_calls
from model_utils.engine import eos_ids
from model_utils.errors import InvalidParameter
from model_utils.runtime.decoders import EagerDecoder
from model_utils.runtime.generation import decode_tokens
from model_utils.runtime.generation_settings import GenerationSettings
from model_utils.runtime.grammar import Grammars, OutputFormat

from .test_batching import greedy, run_together, submit

# Every value bounded, so that even a tiny model's reply closes within the token limit.
SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                         "days": {"type": "integer", "minimum": 1, "maximum": 7},
                         "sunny": {"type": "boolean"},
                         "note": {"type": "string", "maxLength": 12}},
          "required": ["city", "days", "sunny", "note"]}
TOOLS = ({"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "get_time",
                                           "parameters": {"type": "object", "properties": {}}}})
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def valid(value: dict) -> bool:
    return (set(value) == {"city", "days", "sunny", "note"} and value["city"] in
            ("Paris", "Rome", "Oslo") and 1 <= value["days"] <= 7
            and isinstance(value["sunny"], bool) and len(value["note"]) <= 12)


def assert_json_object(update) -> None:
    """A json_object reply is an object; one the token limit cut is the start of one (the
    grammar allows any string, and the demo model may never close its first one: an answer of
    its data holds no quote mark). The schema tests bound their strings."""
    if update.stats.finish_reason == "length":
        assert re.match(r'\s*\{\s*("|$)', update.answer), update.answer
    else:
        assert isinstance(json.loads(update.answer), dict), update.answer


def reply(engine, fmt, n=160, **kwargs):
    settings = GenerationSettings(max_new_tokens=n, temperature=0.0)
    return engine.generate_text(ASK, settings, thinking=False, output_format=fmt, **kwargs)


def test_a_json_schema_reply_parses_and_validates(load_demo):
    final = reply(load_demo("fp32"), OutputFormat("json_schema", SCHEMA))
    assert final.stats.finish_reason == "eos", final.answer
    assert valid(json.loads(final.answer)), final.answer


def test_the_single_stream_decoder_follows_the_constraint_too(load_demo):
    engine = load_demo("fp32")
    loaded = engine.manager.loaded
    vocab = loaded.model.config.get_text_config().vocab_size
    grammars = Grammars(loaded.tokenizer, vocab, eos_ids(loaded))
    constraint = grammars.constraint(OutputFormat("json_schema", SCHEMA), "disabled")
    prompt = engine.render_prompt(ASK, thinking=False)
    ids = loaded.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    tokens = list(decode_tokens(EagerDecoder(loaded.model), ids,
                                greedy(160, fixed=False),
                                eos_ids=eos_ids(loaded), constraint=constraint))
    assert valid(json.loads(loaded.tokenizer.decode(tokens)))


def test_json_object_and_forced_tool_calls(load_demo):
    engine = load_demo("fp32")
    assert_json_object(reply(engine, OutputFormat("json_object")))
    # "required" with one call at most: that call, then the end of the turn (not text up to
    # the token limit).
    one = reply(engine, OutputFormat(tools=TOOLS, tool_choice="required",
                                     parallel_tool_calls=False))
    text, calls = parse_tool_calls(one.answer)
    assert len(calls) == 1 and calls[0].name in ("get_weather", "get_time"), text
    assert text == "" and one.stats.finish_reason == "eos", one.answer
    # Several allowed: calls and nothing else. The tiny model may call again and again; what
    # the token limit cuts is then the start of one more call, never text.
    several = reply(engine, OutputFormat(tools=TOOLS, tool_choice="required"))
    text, calls = parse_tool_calls(several.answer)
    assert len(calls) >= 1 and all(c.name in ("get_weather", "get_time") for c in calls), text
    assert text == "" or (several.stats.finish_reason == "length"
                          and text.startswith("<tool_call>")), several.answer
    named = {"type": "function", "function": {"name": "get_weather"}}
    text, calls = parse_tool_calls(reply(engine, OutputFormat(tools=TOOLS,
                                                              tool_choice=named)).answer)
    assert [c.name for c in calls] == ["get_weather"] and text == ""
    assert valid(json.loads(calls[0].arguments))


def test_free_replies_beside_a_constrained_one_are_what_they_are_alone(load_demo):
    engine = load_demo("fp32")
    serving = engine.serving
    prompts = [[(7 * j + 11 * i) % 900 + 5 for j in range(20 + 30 * i)] for i in range(3)]
    alone = [submit(serving, p, greedy(64))[0] for p in prompts]
    reply(engine, OutputFormat("json_schema", SCHEMA), n=4)  # its grammar compiled: it joins
    jobs = [lambda p=p: submit(serving, p, greedy(64))[0] for p in prompts]
    jobs.append(lambda: reply(engine, OutputFormat("json_schema", SCHEMA)))
    *together, constrained = run_together(jobs)
    assert together == alone
    assert valid(json.loads(constrained.answer)), constrained.answer
    assert constrained.stats.batched_with > 1


def test_a_schema_the_library_cannot_compile_is_refused_naming_the_field(load_demo):
    engine = load_demo("fp32")
    with pytest.raises(InvalidParameter) as refused:
        reply(engine, OutputFormat("json_schema", {"type": "object", "properties": {
            "x": {"$ref": "#/definitions/missing"}}}))
    assert refused.value.name == "response_format"
    assert reply(engine, None, n=8).stats.new_tokens > 0  # and the engine goes on
