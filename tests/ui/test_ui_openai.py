"""The OpenAI-compatible endpoint, called over HTTP against the real app (demo model, CPU)."""

from __future__ import annotations

import base64
import json
import time

import httpx
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
    assert [m["id"] for m in body["data"]] == ["demo model (tiny, trained on questions about this app)"]


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
    ({"messages": MESSAGES, "temperature": -1}, "temperature", "must be >= 0"),
    ({"messages": MESSAGES, "max_tokens": 0}, "max_new_tokens", "between 1"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
     "messages", "end with a user message"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages", "role"),
    ({"messages": [{"role": "user", "content": "  "}]}, "messages", "is empty"),
    ({"messages": [{"role": "user", "content": "word " * 20000}]}, None, "context window"),
    ({"messages": MESSAGES, "stop": ["\n"]}, "stop", "not supported"),
    ({"messages": MESSAGES, "n": 2}, "n", "n=1"),
])
def test_bad_requests_get_400_naming_the_problem(http, body, param, words):
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]


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
    deadline = time.monotonic() + 30
    while True:
        response = http.post("/v1/chat/completions", json={"messages": MESSAGES, **GREEDY})
        if response.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert response.status_code == 200, response.text


def test_with_logins_a_login_is_required(start_app):
    app = start_app("--model", "demo", "--mode", "fp32", "--placement", "cpu",
                    "--auth", "ann:secret")
    with httpx.Client(base_url=app.url, timeout=120) as client:
        body = {"messages": MESSAGES, **GREEDY}
        refused = client.post("/v1/chat/completions", json=body)
        assert refused.status_code == 401
        assert refused.json()["error"]["type"] == "authentication_error"
        wrong = client.post("/v1/chat/completions", json=body,
                            headers={"Authorization": "Bearer ann:wrong"})
        assert wrong.status_code == 401
        assert client.get("/v1/models").status_code == 401
        bearer = client.post("/v1/chat/completions", json=body,
                             headers={"Authorization": "Bearer ann:secret"})
        assert bearer.status_code == 200
        basic = base64.b64encode(b"ann:secret").decode()
        assert client.get("/v1/models", headers={"Authorization": f"Basic {basic}"}) \
            .status_code == 200


def test_without_a_model_a_reply_is_503_and_no_model_is_listed(start_app):
    app = start_app("--model", "/nonexistent/model")
    with httpx.Client(base_url=app.url, timeout=60) as client:
        assert client.get("/v1/models").json()["data"] == []
        response = client.post("/v1/chat/completions", json={"messages": MESSAGES, **GREEDY})
        assert response.status_code == 503
        assert "no model is loaded" in response.json()["error"]["message"]
