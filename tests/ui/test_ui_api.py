"""The named API endpoints, called through gradio_client against the real app (demo model, CPU)."""

from __future__ import annotations

import itertools
import uuid

import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

GREEDY = {"temperature": 0, "max_new_tokens": 24}


@pytest.fixture(scope="module")
def app(start_app):
    return start_app("--model", "demo", "--mode", "bf16", "--placement", "cpu")


@pytest.fixture(scope="module")
def client(app):
    return Client(app.url, verbose=False)


def load(client: Client, mode: str, model: str = "demo") -> dict:
    return client.predict(model, mode, "cpu", api_name="/load_model")


def test_chat_streams_a_reply(client):
    job = client.submit("Tell me about the sea.", [], GREEDY, api_name="/chat")
    updates = list(job)
    # The first piece of text is sent on its own, the rest at most every 50 ms and the end
    # with the stats: at least two updates, however fast the machine decodes.
    assert len(updates) >= 2, "a 24-token reply should arrive in pieces"
    answers = [u["answer"] for u in updates]
    # Streaming: each update extends the one before it.
    assert all(b.startswith(a) for a, b in itertools.pairwise(answers))
    final = updates[-1]
    assert final["done"] is True
    # 24 tokens, or the demo's answer ended before (it rounds differently on other CPUs)
    stats = final["stats"]
    assert (stats["finish_reason"], stats["new_tokens"]) == ("length", 24) or \
        (stats["finish_reason"] == "eos" and 0 < stats["new_tokens"] < 24)
    assert final["stats"]["prompt_tokens"] > 0
    assert "tok/s" in final["stats"]["line"] and "bf16" in final["stats"]["line"]


def test_chat_takes_history_and_system_prompt(client):
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    short = client.predict("Again?", [], GREEDY, api_name="/chat")
    longer = client.predict("Again?", history, GREEDY, "You are terse.", False,
                            api_name="/chat")
    assert longer["stats"]["prompt_tokens"] > short["stats"]["prompt_tokens"]


@pytest.mark.parametrize(("args", "expected"), [
    (("",), "empty"),
    (("hi", [], {"temperature": -1}), "temperature"),
    (("hi", [], {"bogus": 1}), "unknown setting"),
    (("hi", "not a list"), "history must be a list"),
    (("hi", [{"role": "wizard", "content": "x"}]), "role"),
    (("hello " * 5000,), "context window"),  # the engine's too-long message
])
def test_bad_chat_input_is_an_error_status(client, args, expected):
    with pytest.raises(AppError, match=expected):
        client.predict(*args, api_name="/chat")
    assert client.predict("still up?", [], GREEDY, api_name="/chat")["done"]


def test_switch_modes_then_unload(client):
    footprints = {}
    for mode in ("bf16", "nf4", "int8"):
        status = load(client, mode)
        assert status["loaded"] and status["mode"] == mode
        assert status["device_map"]["cpu"]["layers"] == "0-1"
        footprints[mode] = status["footprint_gb"]
        reply = client.predict("Hello", [], GREEDY, api_name="/chat")
        assert mode in reply["stats"]["line"]
    # 4-bit weights take less room than bf16 ones, and int8 sits between them.
    assert footprints["nf4"] < footprints["int8"] < footprints["bf16"]

    unloaded = client.predict(api_name="/unload_model")
    assert unloaded["loaded"] is False
    assert "int8" in unloaded["unloaded"]["model"]
    assert client.predict(api_name="/status")["loaded"] is False
    with pytest.raises(AppError, match="no model is loaded"):
        client.predict("Hello", api_name="/chat")
    assert load(client, "bf16")["mode"] == "bf16"


def test_memory_follows_load_and_unload(client):
    before = client.predict(api_name="/memory")
    assert before["process_rss_gb"] > 0 and before["cpu_total_gb"] > before["cpu_used_gb"] > 0
    if not before["gpus"]:
        assert "no CUDA GPU" in before["note"]
    assert before["model"]["loaded"] and before["model"]["footprint_gb"] > 0

    client.predict(api_name="/unload_model")
    during = client.predict(api_name="/memory")
    assert during["model"]["loaded"] is False and during["model"]["footprint_gb"] is None
    assert during["time"] > before["time"] and during["process_rss_gb"] > 0

    load(client, "nf4")
    after = client.predict(api_name="/memory")
    assert after["model"]["mode"] == "nf4"
    assert 0 < after["model"]["footprint_gb"] < before["model"]["footprint_gb"]
    load(client, "bf16")


def test_bad_path_keeps_the_previous_model(client):
    before = client.predict(api_name="/status")
    with pytest.raises(AppError, match="outside the allowed model folders"):
        load(client, "bf16", model="/nonexistent/model")
    with pytest.raises(AppError, match="unknown mode"):
        load(client, "q3")
    assert client.predict(api_name="/status")["mode"] == before["mode"]
    assert client.predict("Hello", [], GREEDY, api_name="/chat")["done"]


def test_mode_that_does_not_fit_is_refused_before_unloading(client):
    # A CPU cap of 1 MB: the fit check refuses it while the old model still serves; nothing is
    # unloaded or loaded again (the same load time).
    before = client.predict(api_name="/status")
    with pytest.raises(AppError, match="does not fit"):
        client.predict("demo", "fp32", "cpu", {"cpu": 0.001}, api_name="/load_model")
    status = client.predict(api_name="/status")
    assert status["loaded"] and status["mode"] == "bf16"
    assert status["load_s"] == before["load_s"]
    assert client.predict("Hello", [], GREEDY, api_name="/chat")["done"]


@pytest.mark.parametrize(("args", "expected"), [
    ((5,), "message: Input should be a valid string"),
    (("hi", [], None, 123), "system_prompt: Input should be a valid string"),
    (("hi", [], {"<i>x</i>": 1}), "unknown setting(s) <i>x</i>"),  # plain, no &lt;
])
def test_chat_refusals_are_plain_text_naming_the_field(client, args, expected):
    with pytest.raises(AppError) as caught:
        client.predict(*args, api_name="/chat")
    assert expected in str(caught.value) and "&lt;" not in str(caught.value)


@pytest.mark.parametrize(("args", "expected"), [
    (("demo", "bf16", "cpu", [1, 2]), "max_memory_gb: Input should be a valid dictionary"),
    ((123,), "model: Input should be a valid string"),
    (("demo", "bf16", "cpu", None, None, "bf16", "big"), "context_tokens"),
])
def test_load_refusals_name_the_field(client, args, expected):
    with pytest.raises(AppError, match=expected.replace("(", r"\(")):
        client.predict(*args, api_name="/load_model")
    assert client.predict(api_name="/status")["mode"] == "bf16"


def test_log_has_loads_and_replies_but_not_prompts(app, client):
    secret = f"zebra-{uuid.uuid4().hex}"
    client.predict(f"Please remember {secret}", [], GREEDY, "system " + secret,
                   api_name="/chat")
    log = app.log()
    assert "starting with" in log
    assert "loaded demo model" in log and "unloaded demo model" in log
    assert "reply: model=demo model" in log
    assert secret not in log
    assert secret not in app.output()
