"""The OpenAI-compatible endpoint, called over HTTP against the real app (demo model, CPU)."""

from __future__ import annotations

import base64
import json
import time

import httpx
import openai
import pytest
from gradio_client import Client

MESSAGES = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Tell me about the sea."}]
GREEDY = {"temperature": 0, "max_tokens": 24, "enable_thinking": False}


@pytest.fixture(scope="module")
def app(start_app):
    # One reply at a time and no queue: a second request is refused while one streams.
    return start_app("--model", "demo", "--mode", "fp32", "--placement", "cpu",
                     "--max-batch", "1", "--max-queue", "0")


@pytest.fixture(scope="module")
def http(app):
    with httpx.Client(base_url=app.url, timeout=120) as client:
        yield client


def events(response: httpx.Response) -> list:
    """The data of each server-sent event, JSON-decoded ([DONE] kept as the string)."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_models_lists_the_loaded_model(http):
    body = http.get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["demo"]


@pytest.fixture(scope="module")
def client(app):
    return openai.OpenAI(base_url=app.url + "/v1", api_key="unused", timeout=120,
                         max_retries=0)


def ask(client, **kwargs):
    """A greedy reply through the official client (thinking off: the answer is all content)."""
    options = {"model": "demo", "messages": MESSAGES, "temperature": 0, "max_tokens": 40,
               "extra_body": {"enable_thinking": False}, **kwargs}
    return client.chat.completions.create(**options)


def test_the_official_client_lists_and_uses_the_model(client):
    assert [m.id for m in client.models.list()] == ["demo"]
    reply = ask(client, model="anything")
    assert reply.model == "demo" and " " not in reply.model
    # The demo's answer may end before 40 tokens (how it rounds in training depends on the
    # CPU it was built on): the count and the finish reason must agree either way.
    finish, tokens = reply.choices[0].finish_reason, reply.usage.completion_tokens
    assert (finish, tokens) == ("length", 40) or (finish == "stop" and 0 < tokens < 40)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + tokens


def test_the_reply_ends_before_the_first_stop_string(client):
    whole = ask(client).choices[0].message.content
    assert len(whole) > 12
    stop = whole[6:9]  # cut where these three characters first appear
    first = whole.index(stop)
    for value in (stop, [stop], ["never-in-a-reply", stop]):
        reply = ask(client, stop=value)
        assert reply.choices[0].message.content == whole[:first]
        assert reply.choices[0].finish_reason == "stop"


def test_a_streamed_reply_holds_back_what_may_start_a_stop_string(client):
    whole = ask(client).choices[0].message.content
    for start in (3, 8):
        stop = whole[start:start + 3]
        pieces = []
        finish = None
        for chunk in ask(client, stop=[stop], stream=True):
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        # Wherever the chunks were cut, no piece of the stop string was sent ahead of it.
        assert "".join(pieces) == whole[:whole.index(stop)]
        assert finish == "stop"


def test_content_as_a_list_of_text_parts(client):
    parts = [{"role": "system", "content": [{"type": "text", "text": "Answer briefly."}]},
             {"role": "user", "content": [{"type": "text", "text": "Tell me "},
                                          {"type": "text", "text": "about the sea."}]}]
    reply = client.chat.completions.create(model="demo", messages=parts, temperature=0,
                                           max_tokens=40, extra_body={"enable_thinking": False})
    assert reply.choices[0].message.content == ask(client).choices[0].message.content


def test_a_max_tokens_error_names_the_field_the_client_sent(client):
    for value in (0, -5):
        with pytest.raises(openai.BadRequestError) as caught:
            ask(client, max_tokens=value)
        assert caught.value.body["param"] == "max_tokens"
        assert caught.value.body["message"] == f"max_tokens: must be at least 1, got {value}"
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, max_tokens=None, max_completion_tokens=0)
    assert caught.value.body["param"] == "max_completion_tokens"


def test_a_max_tokens_beyond_the_context_is_clamped_to_what_fits(client):
    reply = ask(client, max_tokens=10**6, stop=["never-in-a-reply"])
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert reply.usage.completion_tokens > 0


def test_a_reply_equals_the_chat_endpoints_greedy_reply(http, app):
    reply = http.post("/v1/chat/completions", json={"messages": MESSAGES, **GREEDY}).json()
    choice = reply["choices"][0]
    assert reply["object"] == "chat.completion"
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 24
    assert reply["usage"]["total_tokens"] == reply["usage"]["prompt_tokens"] + 24
    # The same conversation through gradio's /chat: the same engine, the same greedy tokens.
    final = None
    for final in Client(app.url, verbose=False).submit(
            MESSAGES[1]["content"], [], {"temperature": 0, "max_new_tokens": 24},
            MESSAGES[0]["content"], False, api_name="/chat"):
        pass
    assert choice["message"]["content"] == final["answer"]


def test_a_streamed_reply_adds_up_to_the_whole_reply(http):
    whole = http.post("/v1/chat/completions", json={"messages": MESSAGES, **GREEDY}).json()
    with http.stream("POST", "/v1/chat/completions",
                     json={"messages": MESSAGES, **GREEDY, "stream": True,
                           "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        data = events(response)
    assert data[-1] == "[DONE]"
    chunks, usage = data[:-2], data[-2]["usage"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage == whole["usage"]
    assert len({c["id"] for c in chunks}) == 1


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"messages": MESSAGES, "temperature": -1}, "temperature", "temperature: must be >= 0"),
    ({"messages": MESSAGES, "max_tokens": 0}, "max_tokens", "max_tokens: must be"),
    ({"messages": MESSAGES, "max_completion_tokens": -1}, "max_completion_tokens",
     "max_completion_tokens: must be"),
    ({"messages": MESSAGES, "temperature": "hot"}, "temperature", "valid number"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages", "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages", "only text parts"),
    ({"messages": MESSAGES, "stop": [""]}, "stop", "may not be empty"),
    ({"messages": MESSAGES, "stop": 7}, "stop", "a string or a list of strings"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
     "messages", "end with a user message"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages", "role"),
    ({"messages": [{"role": "user", "content": "  "}]}, "messages", "is empty"),
    ({"messages": [{"role": "user", "content": None}]}, "messages", "is empty"),
    ({"messages": [{"role": "user"}]}, "messages", "is empty"),
    ({"messages": [{"role": "user", "content": "word " * 20000}]}, None, "context window"),
    ({"messages": MESSAGES, "n": 2}, "n", "n=1"),
])
def test_bad_requests_get_400_naming_the_problem(http, body, param, words):
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert "max_new_tokens" not in error["message"]  # the client's names, not the engine's


def test_a_body_that_is_not_json_gets_400(http):
    response = http.post("/v1/chat/completions", content=b"{not json",
                         headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and "not JSON" in response.json()["error"]["message"]


def test_busy_then_a_closed_stream_frees_its_place(http):
    long = {"messages": MESSAGES, "temperature": 0, "max_tokens": 4000, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=long) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        # The one place is taken and nothing may wait: "busy", at once.
        busy = http.post("/v1/chat/completions", json={"messages": MESSAGES, **GREEDY})
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert "busy" in busy.json()["error"]["message"]
    # Closing the stream stops that reply, and its place serves the next request.
    deadline = time.monotonic() + 120  # generous: it only matters when the place stays taken
    while True:
        response = http.post("/v1/chat/completions", json={"messages": MESSAGES, **GREEDY})
        if response.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert response.status_code == 200, response.text


@pytest.fixture(scope="module")
def login_app(start_app):
    return start_app("--model", "demo", "--mode", "fp32", "--placement", "cpu",
                     "--auth", "ann:secret", "--auth", "bob:right-one")


def test_with_logins_a_login_is_required(login_app):
    app = login_app
    with httpx.Client(base_url=app.url, timeout=120) as client:
        body = {"messages": MESSAGES, **GREEDY}
        refused = client.post("/v1/chat/completions", json=body)
        assert refused.status_code == 401
        assert refused.headers["www-authenticate"].startswith("Bearer")
        assert refused.json()["error"]["type"] == "authentication_error"
        wrong = client.post("/v1/chat/completions", json=body,
                            headers={"Authorization": "Bearer ann:wrong"})
        assert wrong.status_code == 401
        assert client.get("/v1/models").status_code == 401
        bearer = client.post("/v1/chat/completions", json=body,
                             headers={"Authorization": "Bearer ann:secret"})
        assert bearer.status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=app.url + "/v1", api_key="ann:wrong",
                          max_retries=0).models.list()
        official = openai.OpenAI(base_url=app.url + "/v1", api_key="ann:secret", max_retries=0)
        assert [m.id for m in official.models.list()] == ["demo"]
        basic = base64.b64encode(b"ann:secret").decode()
        assert client.get("/v1/models", headers={"Authorization": f"Basic {basic}"}) \
            .status_code == 200
        text = {"prompt": "Hello", "max_tokens": 2}
        assert client.post("/v1/completions", json=text).status_code == 401
        assert client.post("/v1/completions", json=text,
                           headers={"Authorization": "Bearer ann:secret"}).status_code == 200


def basic_auth(login: str) -> str:
    return "Basic " + base64.b64encode(login.encode()).decode()


def test_wrong_logins_over_the_api_are_logged_and_limited_as_on_the_login_page(login_app):
    tries = [("POST", "/v1/chat/completions", "Bearer bob:guess-1"),
             ("GET", "/v1/models", basic_auth("bob:guess-2")),
             ("POST", "/v1/completions", "Bearer bob:guess-3"),
             ("GET", "/openapi.json", "Bearer bob:guess-4"),
             ("GET", "/v1/models", "Bearer bob:guess-5")]
    with httpx.Client(base_url=login_app.url, timeout=120) as client:
        body = {"messages": MESSAGES, **GREEDY}
        for method, path, authorization in tries:
            wrong = client.request(method, path, json=body if method == "POST" else None,
                                   headers={"Authorization": authorization})
            assert wrong.status_code == 401, (path, wrong.text)
        # Five failures: the name is refused from this address, the right password too, by
        # every way in, with the seconds to wait.
        for authorization in ("Bearer bob:right-one", basic_auth("bob:right-one")):
            limited = client.get("/v1/models", headers={"Authorization": authorization})
            assert limited.status_code == 429
            assert 0 < int(limited.headers["retry-after"]) <= 300
            error = limited.json()["error"]
            assert "too many failed logins for this user" in error["message"]
            assert error["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=login_app.url + "/v1", api_key="bob:right-one",
                          max_retries=0).models.list()
        form = client.post("/login", data={"username": "bob", "password": "right-one"})
        assert form.status_code == 429 and int(form.headers["retry-after"]) > 0
        # Other names are not locked out.
        assert client.get("/v1/models", headers={"Authorization": "Bearer ann:secret"}) \
            .status_code == 200
    log = login_app.log()
    assert log.count("login failed for user 'bob' from 127.0.0.1") == 5
    assert "basic login on '/v1/models'" in log
    assert "guess-" not in log and "right-one" not in log  # passwords are never logged


def test_without_a_model_a_reply_is_503_and_no_model_is_listed(start_app):
    app = start_app("--model", "/nonexistent/model")
    with httpx.Client(base_url=app.url, timeout=60) as client:
        assert client.get("/v1/models").json()["data"] == []
        response = client.post("/v1/chat/completions", json={"messages": MESSAGES, **GREEDY})
        assert response.status_code == 503
        assert "no model is loaded" in response.json()["error"]["message"]
