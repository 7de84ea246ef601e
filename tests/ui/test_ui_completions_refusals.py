"""What /v1/completions refuses, over HTTP against the real app (demo model, CPU): each a 400
naming the field as the client sent it, before anything is answered (a stream included), and
the server serving on afterwards."""

from __future__ import annotations

import httpx
import pytest


@pytest.fixture(scope="module")
def app(start_app):
    return start_app("--model", "demo", "--mode", "fp32", "--placement", "cpu")


@pytest.fixture(scope="module")
def http(app):
    with httpx.Client(base_url=app.url, timeout=120) as client:
        yield client


def refusal(http, body: dict) -> dict:
    response = http.post("/v1/completions", json={"model": "demo", **body})
    assert response.status_code == 400, response.text
    return response.json()["error"]


@pytest.mark.parametrize(("body", "param", "message"), [
    # The chat endpoint's words for the same settings (0 tokens is allowed here: with echo,
    # the prompt scored and nothing generated).
    ({"max_tokens": -5}, "max_tokens", "max_tokens: must be at least 0, got -5"),
    ({"temperature": -1}, "temperature", "temperature: must be >= 0 and <= 100, got -1.0"),
    ({"top_p": 0}, "top_p", "top_p: must be in (0, 1], got 0.0"),
    ({"repetition_penalty": 50}, "repetition_penalty",
     "repetition_penalty: must be >= 0.01 and <= 10, got 50.0"),
])
def test_settings_out_of_range_are_refused_as_on_the_chat_endpoint(http, body, param, message):
    error = refusal(http, {"prompt": "Hello", **body})
    assert (error["param"], error["message"]) == (param, message)


@pytest.mark.parametrize(("prompt", "extra"), [
    ([999999999], {}),
    ([[5, 6], [7, 2050]], {}),  # the demo's vocabulary: 2050 tokens
    ([[5, 6], [7, 2050]], {"echo": True, "max_tokens": 0}),
    ([5, 2050], {"echo": True, "logprobs": 1}),
    ([999999999], {"stream": True}),
])
def test_token_ids_outside_the_vocabulary_are_refused(http, app, prompt, extra):
    error = refusal(http, {"prompt": prompt, "max_tokens": 2, **extra})
    assert error["param"] == "prompt"
    assert "is not in the model's vocabulary (ids 0 to 2049)" in error["message"]
    assert "Traceback" not in app.log()
    # The model is unharmed: the next request is answered.
    assert http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}) \
        .status_code == 200


@pytest.mark.parametrize("body", [
    {"prompt": ""},
    {"prompt": ["Hello", ""]},
    {"prompt": "", "stream": True},
    {"prompt": "", "echo": True, "logprobs": 1, "max_tokens": 0},
])
def test_an_empty_prompt_is_refused_as_empty(http, body):
    error = refusal(http, body)
    assert error["param"] == "prompt"
    assert "a prompt is empty" in error["message"] and "context window" not in error["message"]


def test_best_of_is_refused_as_n_is_and_best_of_1_is_answered(http):
    for name in ("n", "best_of"):
        error = refusal(http, {"prompt": "Hello", name: 2})
        assert (error["param"], error["message"]) == (
            name, f"{name} is not supported on /v1/completions")
        one = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, name: 1})
        assert one.status_code == 200 and len(one.json()["choices"]) == 1
