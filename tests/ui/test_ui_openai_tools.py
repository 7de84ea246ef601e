"""Tools, structured output and logprobs through /v1/chat/completions, with clients nobody here
wrote: the openai package (tool calls whole and streamed, json_schema, json_object, a tool
result in the history, logprobs whole and streamed) and langchain-openai (bind_tools and a ToolMessage round trip, with_structured_output
in json_schema and function_calling modes). The real app, the demo model, the CPU.

The demo model is tiny: it calls a tool or writes JSON only because constrained decoding makes
it, which is what these tests check (a value it may write freely is bounded by its schema, so
that the reply closes within the token limit)."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description":
                                           "The weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                           "parameters": {"type": "object", "properties": {}}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"enable_thinking": False}


class Forecast(BaseModel):
    """A forecast."""

    city: Literal["Paris", "Rome", "Oslo"]
    days: int = Field(ge=1, le=7)
    sunny: bool


@pytest.fixture(scope="module")
def app(start_app):
    return start_app("--model", "demo", "--mode", "fp32", "--placement", "cpu")


@pytest.fixture(scope="module")
def client(app):
    return openai.OpenAI(base_url=app.url + "/v1", api_key="unused", timeout=120,
                         max_retries=0)


def create(client, **kwargs):
    options = {"model": "demo", "messages": ASK, "temperature": 0, "max_tokens": 120,
               "extra_body": NO_THINKING, **kwargs}
    return client.chat.completions.create(**options)


def weather_args(arguments: str) -> dict:
    args = json.loads(arguments)
    assert args["city"] in ("Paris", "Rome", "Oslo") and 1 <= args["days"] <= 7, args
    return args


def test_a_required_tool_call_comes_back_as_tool_calls(client):
    # One call at most: the grammar then ends the turn after it, whatever the model would
    # write next (with several allowed, the tiny model may call again up to max_tokens).
    reply = create(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1 and not choice.message.content  # nothing else
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "get_time")


def test_a_named_tool_is_the_one_called_with_valid_arguments(client):
    reply = create(client, tools=TOOLS,
                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = reply.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather"]
    weather_args(calls[0].function.arguments)


def test_a_streamed_tool_call_assembles_as_the_client_does(client):
    stream = create(client, tools=TOOLS, stream=True,
                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or ():
            entry = calls.setdefault(delta.index, {"name": "", "arguments": "", "id": None})
            entry["id"] = delta.id or entry["id"]
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls"
    assert [c["name"] for c in calls.values()] == ["get_weather"] and calls[0]["id"]
    weather_args(calls[0]["arguments"])


def test_a_tool_result_in_the_history_is_answered(client):
    first = create(client, tools=TOOLS,
                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id,
                      "content": json.dumps({"forecast": "sunny", "celsius": 21})}]
    reply = create(client, messages=history, tools=TOOLS, max_tokens=16)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert reply.usage.prompt_tokens > first.usage.prompt_tokens


def test_json_schema_and_json_object_replies_parse(client):
    parsed = client.chat.completions.parse(model="demo", messages=ASK, temperature=0,
                                           max_tokens=120, response_format=Forecast,
                                           extra_body=NO_THINKING)
    forecast = parsed.choices[0].message.parsed
    assert isinstance(forecast, Forecast), parsed.choices[0].message.content
    reply = create(client, response_format={"type": "json_object"})
    content, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
    # Cut by max_tokens, it is the start of an object: the grammar allows any string, and the
    # demo model may never close its first one (an answer of its data holds no quote mark).
    if finish == "length":
        assert content.lstrip().startswith('{'), content
    else:
        assert isinstance(json.loads(content), dict), content


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/definitions/none"}}}}}},
     "response_format"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
])
def test_what_cannot_be_met_is_a_400_naming_the_field(app, body, param):
    with httpx.Client(base_url=app.url, timeout=60) as http:
        response = http.post("/v1/chat/completions", json={"messages": ASK, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f",
                                                  "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_a_schema_the_grammar_refuses_is_named_without_the_librarys_internals(app, body, param):
    with httpx.Client(base_url=app.url, timeout=60) as http:
        response = http.post("/v1/chat/completions", json={"messages": ASK, **body})
    assert response.status_code == 400, response.text
    # Not the library's log prefix ("[04:12:10] /project/cpp/json_schema_converter.cc:5082: ").
    assert response.json()["error"]["message"] == f'{param}: Unsupported type "nonsense"'


def test_logprobs_whole_and_streamed(client):
    reply = create(client, messages=[{"role": "user", "content": "What is bf16?"}],
                   max_tokens=12, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    for token in content:  # greedy: the token drawn is the likeliest
        assert len(token.top_logprobs) == 3 and token.logprob <= 0
        assert token.top_logprobs[0].token == token.token
        assert token.top_logprobs[0].logprob == pytest.approx(token.logprob)
        assert bytes(token.bytes).decode() == token.token
    streamed = []
    for chunk in create(client, messages=[{"role": "user", "content": "What is bf16?"}],
                        max_tokens=12, logprobs=True, top_logprobs=3, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content or []
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == \
        [(t.token, round(t.logprob, 4)) for t in content]


def test_langchain_bind_tools_and_a_tool_message_round_trip(app):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo"], days: int) -> str:
        """The weather in a city for some days."""
        return "sunny"

    llm = ChatOpenAI(base_url=app.url + "/v1", api_key="unused", model="demo", temperature=0,
                     max_tokens=120, max_retries=0, extra_body=NO_THINKING)
    bound = llm.bind_tools([get_weather], tool_choice="get_weather")
    question = HumanMessage("What is the weather in Paris?")
    message = bound.invoke([question])
    assert [c["name"] for c in message.tool_calls] == ["get_weather"], message
    call = message.tool_calls[0]
    assert call["args"]["city"] in ("Paris", "Rome", "Oslo")
    answer = llm.bind_tools([get_weather]).invoke(
        [question, message, ToolMessage("sunny, 21 C", tool_call_id=call["id"])])
    assert answer.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(app, method):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=app.url + "/v1", api_key="unused", model="demo", temperature=0,
                     max_tokens=120, max_retries=0, extra_body=NO_THINKING)
    forecast = llm.with_structured_output(Forecast, method=method).invoke(
        "What is the weather in Paris?")
    assert isinstance(forecast, Forecast)


def test_through_a_front_with_backend_tools_and_formats_pass_through(start_app, app):
    front = start_app("--backend", app.url + "/v1")
    client = openai.OpenAI(base_url=front.url + "/v1", api_key="unused", timeout=120,
                           max_retries=0)
    reply = create(client, tools=TOOLS,
                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert reply.choices[0].finish_reason == "tool_calls"
    calls = reply.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather"]
    weather_args(calls[0].function.arguments)
    history = ASK + [reply.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"}]
    assert create(client, messages=history, tools=TOOLS, max_tokens=8).choices
    parsed = client.chat.completions.parse(model="demo", messages=ASK, temperature=0,
                                           max_tokens=120, response_format=Forecast,
                                           extra_body=NO_THINKING)
    assert isinstance(parsed.choices[0].message.parsed, Forecast)
    asked = {"messages": [{"role": "user", "content": "What is bf16?"}], "max_tokens": 6,
             "logprobs": True, "top_logprobs": 2}
    there, here = create(client, **asked), create(openai.OpenAI(
        base_url=app.url + "/v1", api_key="unused", max_retries=0), **asked)
    assert [t.token for t in there.choices[0].logprobs.content] == \
        [t.token for t in here.choices[0].logprobs.content]


def test_completions_with_logprobs_agree_with_the_prompt_scored_by_echo(client):
    reply = client.completions.create(model="demo", prompt="bf16 is", max_tokens=6,
                                      temperature=0, logprobs=2)
    choice = reply.choices[0]
    assert choice.finish_reason in ("length", "stop")
    generated = choice.logprobs
    n = reply.usage.completion_tokens
    # One entry more when the reply ended at the EOS: that token is scored too, as OpenAI's
    # and vLLM's is, and is no part of the text.
    assert len(generated.tokens) == n + (choice.finish_reason == "stop")
    assert "".join(generated.tokens[:n]) == choice.text
    for value, top in zip(generated.token_logprobs, generated.top_logprobs):
        assert value == pytest.approx(max(top.values()))  # greedy: the likeliest
    scored = client.completions.create(model="demo", prompt="bf16 is" + choice.text,
                                       max_tokens=0, echo=True, logprobs=1).choices[0]
    assert scored.text == "bf16 is" + choice.text and scored.logprobs.token_logprobs[0] is None
    assert scored.logprobs.tokens[-n:] == generated.tokens[:n]
    # The continuation's tokens scored with the prompt = their log-probabilities when drawn.
    assert scored.logprobs.token_logprobs[-n:] == pytest.approx(generated.token_logprobs[:n],
                                                                abs=1e-3)


def test_a_log_likelihood_request_as_lm_eval_sends_it(app):
    """Token ids (one list per prompt), max_tokens 1, echo, logprobs 1: every prompt token
    scored and the one drawn after them, one choice per prompt."""
    body = {"model": "demo", "prompt": [[5, 6, 7, 8], [9, 10, 11]], "max_tokens": 1,
            "temperature": 0, "logprobs": 1, "echo": True, "seed": 1234}
    with httpx.Client(base_url=app.url, timeout=60) as http:
        out = http.post("/v1/completions", json=body).json()
        assert [c["index"] for c in out["choices"]] == [0, 1]
        for choice, prompt in zip(out["choices"], body["prompt"]):
            values = choice["logprobs"]["token_logprobs"]
            assert len(values) == len(prompt) + 1 and values[0] is None
            assert all(v <= 0 for v in values[1:])
        refused = http.post("/v1/completions", json={**body, "stream": True})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream"


TINY_TASK = """task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
TINY_DOCS = [{"question": "Which mode uses 4-bit weights?", "choices": [" nf4", " bf16"],
              "answer": 0},
             {"question": "What does the Memory tab show?",
              "choices": [" GPU memory", " the weather"], "answer": 0}]


def test_lm_eval_local_completions_log_likelihoods_are_the_models(app, tmp_path):
    """lm-eval's local-completions on a small local task: each log-likelihood it reads from
    /v1/completions is the one transformers computes from the same checkpoint."""
    import lm_eval
    import torch
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from model_utils.loading.demo_model import demo_model_path

    data = tmp_path / "docs.jsonl"
    data.write_text("\n".join(json.dumps(d) for d in TINY_DOCS) + "\n")
    (tmp_path / "tiny.yaml").write_text(TINY_TASK.format(data=data))
    folder = str(demo_model_path())
    result = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": app.url + "/v1/completions", "model": "demo",
                    "tokenizer": folder, "tokenizer_backend": "huggingface",
                    "num_concurrent": 1, "max_retries": 1},
        tasks=["tiny_choice"], task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True)
    assert 0 <= result["results"]["tiny_choice"]["acc,none"] <= 1
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    pairs = [(args, resp[0][0]) for sample in result["samples"]["tiny_choice"]
             for args, resp in zip(sample["arguments"], sample["resps"])]
    assert len(pairs) == 4
    for (context, continuation), got in pairs:
        start = len(tokenizer(context, add_special_tokens=False)["input_ids"])
        ids = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)
        want = sum(logp[i - 1, ids[i]].item() for i in range(start, len(ids)))
        assert got == pytest.approx(want, abs=1e-3), (context, continuation)


def test_a_streamed_completion_adds_up_to_the_whole_one(client):
    asked = {"model": "demo", "prompt": "bf16 is", "max_tokens": 8, "temperature": 0,
             "logprobs": 1, "echo": True}
    whole = client.completions.create(**asked).choices[0]
    text, tokens, finish = "", [], None
    for chunk in client.completions.create(stream=True, **asked):
        choice = chunk.choices[0]
        text += choice.text
        tokens += choice.logprobs.tokens if choice.logprobs else []
        finish = choice.finish_reason or finish
    assert text == whole.text and text.startswith("bf16 is")
    assert tokens == whole.logprobs.tokens and finish == whole.finish_reason
