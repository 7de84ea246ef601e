"""The model-server front end against a fake server that misbehaves on purpose: the engine
in process (RemoteEngine) for each fault, then the app itself (python app.py --backend) for
what its own API clients and pages see. Everything on loopback, every wait bounded."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from gradio_client import Client

from model_utils.backends.errors import BackendBusy, BackendError, BackendTimeout
from model_utils.backends.openai_client import ServerConfig
from model_utils.backends.remote import RemoteEngine
from model_utils.runtime.generation_settings import GenerationSettings

from .conftest import free_port
from .fake_model_server import MODEL, FakeModelServer

HELLO = [{"role": "user", "content": "Hello?"}]


@pytest.fixture()
def server():
    fake = FakeModelServer(key="sk-fake").start()
    yield fake
    fake.stop()


def engine_for(url: str, key: str | None = "sk-fake", **timeouts) -> RemoteEngine:
    config = ServerConfig(url, key=key, **{"connect_timeout_s": 2.0, "read_timeout_s": 1.0,
                                           "reply_timeout_s": 30.0, **timeouts})
    return RemoteEngine(config, max_batch=2, max_queue=0, health_interval_s=0.5,
                        health_retry_s=0.2)


@pytest.fixture()
def engine(server):
    remote = engine_for(server.url)
    yield remote
    remote.close()


def test_a_reply_carries_reasoning_apart_and_the_servers_usage(engine, server):
    final = engine.generate_text(HELLO, GenerationSettings(temperature=0.5, top_k=5, seed=3),
                                 thinking=False)
    assert (final.reasoning, final.answer) == ("Thinking about it.", "Hello there.")
    assert final.stats.finish_reason == "eos" and not final.notice
    assert (final.stats.prompt_tokens, final.stats.new_tokens) == (12, 3)
    assert final.stats.cached_tokens == 8  # the server's prompt caching, passed on
    assert final.stats.ttft_ms > 0
    body = server.bodies[-1]
    assert body["model"] == MODEL and body["stream"] is True
    assert (body["temperature"], body["top_k"], body["seed"]) == (0.5, 5, 3)
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert "repetition_penalty" not in body and "max_tokens" not in body  # the server's own


def test_thinking_left_in_the_text_is_split_off(engine, server):
    server.mode = "think_in_content"
    updates = list(engine.chat(HELLO))
    assert (updates[0].reasoning, updates[0].answer) == ("Hm", "")
    assert (updates[-1].reasoning, updates[-1].answer) == ("Hmm.", "Hi.")


def test_status_names_the_server_its_models_and_health_never_the_key(engine, server):
    status = engine.status()
    assert status["loaded"] and status["models"] == [MODEL] and status["model"] == MODEL
    assert status["backend_url"] == server.url and status["context_tokens"] == 4096
    assert status["health"]["ok"] and status["health"]["latency_ms"] is not None
    assert "sk-fake" not in repr(status)


def test_an_extension_the_server_refuses_is_dropped_with_a_notice(engine, server):
    server.mode = "refuse_top_k"
    final = engine.generate_text(HELLO, GenerationSettings(top_k=20))
    assert final.answer == "Hello there."
    assert "does not take top_k" in final.notice
    assert "top_k" in server.bodies[-2] and "top_k" not in server.bodies[-1]
    # Not sent again: one request for the next reply.
    count = len(server.bodies)
    assert "top_k" in engine.generate_text(HELLO, GenerationSettings(top_k=20)).notice
    assert len(server.bodies) == count + 1 and "top_k" not in server.bodies[-1]


@pytest.mark.parametrize(("mode", "error", "words", "status", "retry"), [
    ("401", BackendError, "refused this app's credentials", 502, None),
    ("429", BackendBusy, "request limit", 429, "7"),
    ("503", BackendBusy, "busy or starting", 503, "7"),
    ("500", BackendError, r"failed \(HTTP 500\): fake 500", 502, None),
    ("malformed", BackendError, "not JSON", 502, None),
    ("not_sse", BackendError, "did not stream its reply", 502, None),
    # Silent before its headers: httpx's read timeout and the header watch (stream_watch.py)
    # both end it at 1 s, and whichever fires first gives its own words.
    ("slow_start", BackendTimeout, "sent no(thing| complete answer headers) for 1 s", 504, None),
])
def test_refusals_before_the_first_token_are_clear_errors(engine, server, mode, error, words,
                                                          status, retry):
    server.mode = mode
    start = time.monotonic()
    with pytest.raises(error, match=words) as raised:
        engine.generate_text(HELLO)
    assert time.monotonic() - start < 10
    assert raised.value.http_status == status and raised.value.retry_after == retry
    assert engine.queue_status()["active"] == 0
    server.mode = "ok"  # and the next request works
    assert engine.generate_text(HELLO).answer == "Hello there."


def test_a_server_dying_mid_reply_ends_it_with_a_notice(engine, server):
    server.mode = "die"
    final = engine.generate_text(HELLO)
    assert final.done and final.answer == "Hello" and final.stats.finish_reason == "error"
    assert "cut short" in final.notice and "closed the connection" in final.notice
    server.mode = "no_done"
    final = engine.generate_text(HELLO)
    assert final.stats.finish_reason == "error" and "without finishing" in final.notice
    server.mode = "ok"
    assert engine.generate_text(HELLO).stats.finish_reason == "eos"


def test_stop_closes_the_upstream_stream(engine, server):
    server.mode = "trickle"
    stop = threading.Event()
    updates = engine.chat(HELLO, stop=stop)
    first = next(updates)
    assert first.answer.startswith("w0")
    stop.set()
    final = None
    for final in updates:
        pass
    assert final.done and final.stats.stopped and final.stats.finish_reason == "stop"
    assert server.hung_up.wait(10), "the server was still writing to a stopped reply"
    assert engine.queue_status()["active"] == 0


def test_stop_works_while_the_server_is_silent(server):
    """A reply queued at the server (headers sent, no token yet): Stop still ends it at once
    rather than after the read timeout."""
    server.mode = "silent"
    remote = engine_for(server.url, read_timeout_s=30.0)
    try:
        stop = threading.Event()
        threading.Timer(0.5, stop.set).start()
        start = time.monotonic()
        final = remote.generate_text(HELLO, stop=stop)
        assert time.monotonic() - start < 4.5  # before the server speaks again (5 s)
        assert final.stats.stopped and final.answer == "" and not final.notice
        server.mode = "ok"  # the hung-up connection is not reused: the next reply works
        assert remote.generate_text(HELLO).answer == "Hello there."
    finally:
        remote.close()


def test_a_closed_consumer_closes_the_upstream_stream_too(engine, server):
    server.mode = "trickle"
    updates = engine.chat(HELLO)
    next(updates)
    updates.close()  # a closed tab, a dropped API client
    assert server.hung_up.wait(10)


def test_the_whole_reply_is_bounded(server):
    server.mode = "trickle"  # never silent for a read timeout, but never ending either
    remote = engine_for(server.url, reply_timeout_s=1.0)
    try:
        start = time.monotonic()
        final = remote.generate_text(HELLO)
        assert time.monotonic() - start < 10
        assert final.stats.finish_reason == "error" and "longer than 1 s" in final.notice
    finally:
        remote.close()


def test_a_server_that_is_down_then_up(server):
    port = free_port()
    remote = engine_for(f"http://127.0.0.1:{port}/v1")
    try:
        status = remote.status()
        assert not status["loaded"] and not status["health"]["ok"]
        assert "not reachable" in status["health"]["error"]
        with pytest.raises(BackendError, match="not reachable") as raised:
            remote.generate_text(HELLO)
        assert raised.value.http_status == 503 and raised.value.retry_after
        late = FakeModelServer(port=port).start()
        try:
            # The next request works at once; the health check follows within its retry.
            assert remote.generate_text(HELLO).answer == "Hello there."
            deadline = time.monotonic() + 10
            while not remote.status()["health"]["ok"] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert remote.status()["loaded"]
        finally:
            late.stop()
    finally:
        remote.close()


def test_load_and_unload_are_refused_with_the_reason(engine):
    from model_utils.errors import LoadError

    for action in (lambda: engine.load(None), engine.unload, lambda: engine.estimate(None)):
        with pytest.raises(LoadError, match="models, modes and placements are chosen there"):
            action()


def wait_for_v1(http: httpx.Client, headers: dict | None = None) -> None:
    """The /v1 routes join gradio's app right after it starts serving: wait for them."""
    deadline = time.monotonic() + 30
    while http.get("/v1/models", headers=headers).status_code == 404:
        assert time.monotonic() < deadline, "/v1 never appeared"
        time.sleep(0.1)


def test_the_front_maps_faults_for_its_own_clients(start_app, tmp_path):
    """The app itself in front of the fake server: down at start, then 429/503 passed on with
    Retry-After, a mid-reply death reported in band, and the gradio endpoint's messages."""
    port = free_port()
    key_file = tmp_path / "key"
    key_file.write_text("sk-fake\n")
    app = start_app("--backend", f"http://127.0.0.1:{port}/v1", "--backend-key-file",
                    str(key_file), "--backend-read-timeout", "2")
    with httpx.Client(base_url=app.url, timeout=30) as http:
        wait_for_v1(http)
        body = {"messages": HELLO, "max_tokens": 8}
        down = http.post("/v1/chat/completions", json=body)
        assert down.status_code == 503 and down.headers["retry-after"]
        assert "not reachable" in down.json()["error"]["message"]
        assert "127.0.0.1" not in down.json()["error"]["message"]  # the address stays inside
        status = Client(app.url, verbose=False).predict(api_name="/status")
        assert not status["loaded"] and not status["health"]["ok"]
        fake = FakeModelServer(port=port, key="sk-fake").start()
        try:
            ok = http.post("/v1/chat/completions", json=body)
            assert ok.status_code == 200
            assert ok.json()["choices"][0]["message"]["content"] == "Hello there."
            for mode, code in (("429", 429), ("503", 503)):
                fake.mode = mode
                busy = http.post("/v1/chat/completions", json=body)
                assert busy.status_code == code and busy.headers["retry-after"] == "7"
            # The official client sees the same: a RateLimitError with the server's wait.
            from openai import OpenAI, RateLimitError

            client = OpenAI(base_url=app.url + "/v1", api_key="-", max_retries=0, timeout=30)
            fake.mode = "429"
            with pytest.raises(RateLimitError) as limited:
                client.chat.completions.create(model=MODEL, messages=HELLO)
            assert limited.value.response.headers["retry-after"] == "7"
            fake.mode = "die"
            cut = http.post("/v1/chat/completions", json=body)
            assert cut.status_code == 502 and "cut short" in cut.json()["error"]["message"]
            with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) \
                    as response:
                lines = [line for line in response.iter_lines() if line.startswith("data: ")]
            assert any('"content": "Hello"' in line for line in lines)
            # An error event, then [DONE], as any failure after the start of a stream
            assert "cut short" in lines[-2] and lines[-1] == "data: [DONE]"
            from openai import APIError

            with pytest.raises(APIError, match="cut short"):
                for _ in client.chat.completions.create(model=MODEL, messages=HELLO,
                                                        stream=True):
                    pass
            final = Client(app.url, verbose=False).predict("Hi", [], {}, "", True,
                                                           api_name="/chat")
            assert final["answer"] == "Hello" and "cut short" in final["notice"]
            fake.mode = "ok"
            assert http.post("/v1/chat/completions", json=body).status_code == 200
        finally:
            fake.stop()
    assert "sk-fake" not in app.log() and "sk-fake" not in app.output()


def test_stop_on_the_page_hangs_up_on_the_server(start_app):
    """The Stop button in front of a server whose reply would last 100 s: the reply ends as
    stopped at once, and the server sees the connection close."""
    from .browser import open_browser

    fake = FakeModelServer().start()
    try:
        app = start_app("--backend", fake.url)
        fake.mode = "trickle"
        with open_browser() as browser:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(30000)
            page.goto(app.url)
            page.locator("#message textarea").fill("Go on and on.")
            page.locator("#message textarea").press("Enter")
            page.locator("#chatbot").get_by_text("w3 ").wait_for()
            assert not fake.hung_up.is_set()
            page.locator("#stop").click()
            page.locator("#chatbot sub", has_text="stopped").wait_for()
            assert fake.hung_up.wait(10), "the server was still writing to a stopped reply"
            assert "w1999" not in page.locator("#chatbot").inner_text()
    finally:
        fake.stop()
