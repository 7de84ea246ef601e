"""The app itself (python app.py --backend, logins, an admin, 3 places) in front of a model
server that misbehaves on purpose, each case beside other users' replies (attacks.Victims):
the plain message its own clients get, the app still serving, their replies complete, the key
nowhere; clients that go away (/v1 or gradio's /chat) free their places; a guest cannot run
the benchmark."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import httpx
import pytest
from gradio_client import Client

from model_utils.backends.sse import MAX_EVENT_BYTES, MAX_LINE_BYTES

from .attacks import (
    Victims,
    by_route,
    chat_stream,
    page_handler,
    page_load_outputs,
    page_login,
    plain_problems,
)
from .fake_model_server import FakeModelServer
from .test_remote_faults import wait_for_v1

KEY = "sk-fake"
ADMIN, GUEST = ("ann", "ann-secret"), ("bob", "bob-secret")
BEARER = {"Authorization": f"Bearer {GUEST[0]}:{GUEST[1]}"}
PLACES = 3  # --max-batch 3 --max-queue 0
ADMIN_ONLY = "only the admin user (ann) may run the benchmark; you are 'bob'"


@pytest.fixture(scope="module")
def fake():
    server = FakeModelServer(key=KEY)
    server.models_mode = "500_key"  # the app's first check of it quotes the key back
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def app(start_app, fake, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("key") / "key"
    key_file.write_text(KEY + "\n")
    return start_app("--backend", fake.url, "--backend-key-file", str(key_file),
                     "--auth", ":".join(ADMIN), "--auth", ":".join(GUEST), "--admin", ADMIN[0],
                     "--max-batch", str(PLACES), "--max-queue", "0",
                     "--backend-read-timeout", "30")


@pytest.fixture(scope="module")
def http(app):
    with httpx.Client(base_url=app.url, timeout=60, headers=BEARER) as client:
        wait_for_v1(client)
        yield client


@pytest.fixture(scope="module")
def guest(app):
    return Client(app.url, auth=GUEST, verbose=False)


def serving(fake, guest) -> None:
    """The server answering /models again, and the app having seen it (each test may run
    alone, after the first left it quoting the key)."""
    fake.models_mode = "ok"
    deadline = time.monotonic() + 20
    while not guest.predict(api_name="/status")["health"]["ok"]:
        assert time.monotonic() < deadline, "the app never saw the server come back"
        time.sleep(0.3)


def victims(app) -> Victims:
    return Victims(app.url, v1_headers=BEARER,
                   gradio=Client(app.url, auth=GUEST, verbose=False)).start()


def hostile(mode: str) -> list[dict]:
    return [{"role": "user", "content": f"fake-mode: {mode}"}]


def test_the_key_the_server_quotes_reaches_no_guest_and_no_log(app, fake, http, guest):
    status = guest.predict(api_name="/status")
    assert not status["health"]["ok"] and "[redacted]" in status["health"]["error"]
    page = page_login(app.url, *GUEST)
    try:
        model_tab = page_handler(page, "refresh", {})
        assert model_tab.status == 200 and "[redacted]" in model_tab.message
        assert KEY not in json.dumps(status) + model_tab.message
        assert KEY not in page.get("/config").text
    finally:
        page.close()
    serving(fake, guest)
    assert KEY not in app.log() and KEY not in app.output()


# (id, request body, expected status, words the message must have)
HOSTILE_CASES = [
    ("400-quoting-the-key", {"messages": hostile("400_key")}, 400, "Bearer [redacted]"),
    ("error-event-quoting-the-key", {"messages": hostile("error_event_key")}, 502,
     "[redacted]"),
    ("error-event-quoting-the-key-streamed", {"messages": hostile("error_event_key"),
                                              "stream": True}, 200, "[redacted]"),
    ("a-line-without-end", {"messages": hostile("long_line")}, 502,
     f"a line of more than {MAX_LINE_BYTES // 1024} KB"),
    ("a-huge-event", {"messages": hostile("huge_event")}, 502,
     f"an event larger than {MAX_EVENT_BYTES // 1024} KB"),
    ("reasoning-past-max-tokens", {"messages": hostile("reasoning_flood"), "max_tokens": 16},
     200, '"finish_reason":"length"'),
    ("a-lone-surrogate-streamed", {"messages": hostile("surrogate"), "stream": True}, 200,
     '"content": "a\ufffdb"'),
]


@pytest.mark.parametrize(("body", "status", "words"), [c[1:] for c in HOSTILE_CASES],
                         ids=[c[0] for c in HOSTILE_CASES])
def test_a_hostile_server_reply_is_refused_plainly_and_hurts_no_one(app, fake, guest, http,
                                                                    body, status, words):
    serving(fake, guest)
    others = victims(app)
    response = http.post("/v1/chat/completions", json=body)
    results = others.finish()
    text = response.text
    if status != 200:
        text = response.json()["error"]["message"]
        assert not plain_problems(text), text
    assert response.status_code == status, response.text[:500]
    assert words in text, text[:500]
    assert KEY not in response.text
    if body.get("stream"):
        assert text.rstrip().endswith("data: [DONE]")  # the event stream was not broken
    if "max_tokens" in body:
        reasoning = response.json()["choices"][0]["message"]["reasoning_content"]
        assert reasoning.split() == ["hmm"] * 16
    assert results == {"v1": "complete", "chat": "complete"}
    assert http.get("/v1/models").status_code == 200
    assert KEY not in app.log()


def test_the_official_client_reads_a_reply_with_a_lone_surrogate(app, fake, guest):
    serving(fake, guest)
    from openai import OpenAI

    client = OpenAI(base_url=app.url + "/v1", api_key=":".join(GUEST), max_retries=0,
                    timeout=30)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in
                   client.chat.completions.create(model="x", messages=hostile("surrogate"),
                                                  stream=True) if chunk.choices)
    assert text == "a\ufffdb"


def open_and_leave(app, mode: str, *, stream: bool) -> socket.socket:
    """A /v1 client that sends its request and then only waits (closed by the caller)."""
    body = json.dumps({"messages": hostile(mode), "stream": stream}).encode()
    sock = socket.create_connection(("127.0.0.1", app.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nAuthorization: " +
                 BEARER["Authorization"].encode() +
                 f"\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def wait_until(condition, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, what
        time.sleep(0.05)
    return time.monotonic() - start


def test_clients_that_go_away_free_their_places_at_once(app, fake, guest, http):
    """Every place held by a client whose server trickles (no timeout would fire for 30 s):
    one waiting for its first token without streaming, one streaming, one streaming after
    its first token. They leave; the places are free within a second and the server's
    connections are closed."""
    serving(fake, guest)
    admin = Client(app.url, auth=ADMIN, verbose=False)
    hangups = fake.hangups
    clients = [open_and_leave(app, "byte_trickle", stream=False),
               open_and_leave(app, "byte_trickle", stream=True),
               open_and_leave(app, "token_then_byte_trickle", stream=True)]
    wait_until(lambda: fake.open_streams == PLACES, 20, "the replies never reached the server")
    busy = http.post("/v1/chat/completions", json={"messages": hostile("ok")})
    assert busy.status_code == 503 and "already in flight" in busy.json()["error"]["message"]
    for sock in clients:
        sock.close()
    # Timed by the server's side (a counter in this process): the app drops a departed
    # client's reply and its connection to the server at once. The status is read after,
    # since each of its reads is a round trip through a busy app's queue.
    freed = wait_until(lambda: fake.hangups >= hangups + PLACES, 10, "the server kept writing")
    print(f"replies dropped {freed:.2f} s after the clients left")
    assert freed < 1.5, f"replies dropped after {freed:.2f} s"
    wait_until(lambda: admin.predict(api_name="/status")["queue"]["active"] == 0, 5,
               "the places were not freed")
    assert victims(app).finish() == {"v1": "complete", "chat": "complete"}


def test_a_gradio_client_that_leaves_mid_reply_frees_its_place_at_once(app, fake, guest):
    """gradio's /chat through the queue, as gradio_client opens it, on a reply whose server
    trickles bytes: no update reaches the client's event stream, so gradio alone noticed the
    client leave only 10-15 s later. It closes the stream: the place is free within seconds
    and the server's connection closed."""
    serving(fake, guest)
    page = page_login(app.url, *GUEST)
    hangups = fake.hangups
    try:
        with chat_stream(page, "fake-mode: byte_trickle"):
            wait_until(lambda: fake.open_streams == 1, 20, "the reply never reached the server")
            assert guest.predict(api_name="/status")["queue"]["active"] == 1
        freed = wait_until(lambda: guest.predict(api_name="/status")["queue"]["active"] == 0,
                           10, "the place was not freed")
        print(f"place freed {freed:.2f} s after the client left")
        assert freed < 5, f"place freed after {freed:.2f} s"
        wait_until(lambda: fake.hangups > hangups, 5, "the server kept writing")
    finally:
        page.close()
    assert victims(app).finish() == {"v1": "complete", "chat": "complete"}


def setting_position(page: httpx.Client, label_start: str) -> int:
    """Where the page's send handler takes the widget whose label starts so."""
    config = page.get("/config").json()
    labels = {c["id"]: c["props"].get("label") or "" for c in config["components"]}
    dep = next(d for d in config["dependencies"] if d.get("api_name") == "respond")
    return next(i for i, c in enumerate(dep["inputs"]) if labels[c].startswith(label_start))


def test_sliders_left_where_they_started_leave_sampling_to_the_server(app, fake, guest):
    """A server that reports no sampling defaults (vLLM: it applies the model's
    generation_config to what a request leaves unset, and says so nowhere): the sliders'
    notes say "server default", and a message sent from the page as it opened carries no
    temperature, top_p or top_k, not this page's 0.7 / 1 / 0. A slider moved is sent."""
    serving(fake, guest)
    page = page_login(app.url, *GUEST)
    try:
        loaded = page_load_outputs(page)["on_page_load"]
        assert loaded.count("server default (the server does not say its value)") == 4
        sent = page_handler(page, "respond", {0: "Hello?"})
        assert sent.status == 200 and "Hello there." in sent.message, sent
        body = fake.bodies[-1]
        assert not {"temperature", "top_p", "top_k"} & set(body), body
        moved = page_handler(page, "respond", {0: "Hello?",
                                               setting_position(page, "temperature"): 0.3})
        assert moved.status == 200, moved
        assert fake.bodies[-1]["temperature"] == 0.3 and "top_p" not in fake.bodies[-1]
    finally:
        page.close()


def test_a_stuck_server_reply_blocks_no_other_user(app, fake, guest):
    serving(fake, guest)
    stuck = open_and_leave(app, "byte_trickle", stream=True)
    try:
        wait_until(lambda: fake.open_streams == 1, 20, "the reply never reached the server")
        assert victims(app).finish() == {"v1": "complete", "chat": "complete"}
    finally:
        stuck.close()


def bench(page: httpx.Client, new_tokens=8, streams=("1",)):
    return page_handler(page, "run", {0: new_tokens, 1: list(streams)
                                      if isinstance(streams, tuple) else streams})


@pytest.mark.parametrize("attack", [
    lambda page: bench(page),
    lambda page: bench(page, 8, ["32", "32"]),
    lambda page: bench(page, "many"),
    lambda page: by_route(page, "run", [8, ["32"]]),
], ids=["bench-as-guest", "bench-as-guest-32-streams", "bench-as-guest-a-string-size",
        "bench-as-guest-by-route"])
def test_a_guest_cannot_run_the_benchmark(app, fake, guest, attack):
    serving(fake, guest)
    requests, page = len(fake.bodies), page_login(app.url, *GUEST)
    try:
        others = victims(app)
        outcome = attack(page)
        assert others.finish() == {"v1": "complete", "chat": "complete"}
    finally:
        page.close()
    assert outcome.status == "error" and ADMIN_ONLY in outcome.message, outcome
    assert not plain_problems(outcome.message), outcome
    assert len(fake.bodies) == requests + 2  # the two other users' replies, nothing more


def test_the_admin_runs_the_benchmark_and_bad_sizes_are_named(app, fake, guest):
    serving(fake, guest)
    page = page_login(app.url, *ADMIN)
    try:
        ran = bench(page, 8, ["1"])
        assert ran.status == 200 and "| 1 | 1 | 0 |" in ran.message, ran
        for sizes, words in (((12.5, ["1"]), "new tokens must be a whole number"),
                             ((8, "8"), "concurrent streams must be a list"),
                             ((8, ["1000"]), "streams must be between 1 and 256")):
            refused = bench(page, *sizes)
            assert refused.status == "error" and words in refused.message, refused
            assert not plain_problems(refused.message), refused
    finally:
        page.close()


def test_other_users_replies_complete_during_the_admins_32_stream_benchmark(app, fake, guest):
    """3 places: the benchmark's 32 streams take at most one at a time (two stay for other
    users), so both innocent replies are served while it runs, and none of its own fails."""
    serving(fake, guest)
    fake.mode = "trickle"  # a piece every 0.05 s: each stream lasts its 8 tokens' 0.4 s
    page = page_login(app.url, *ADMIN)
    done: dict = {}
    runner = threading.Thread(target=lambda: done.update(outcome=bench(page, 8, ["32"])),
                              daemon=True)
    try:
        runner.start()
        wait_until(lambda: fake.open_streams >= 1, 60, "the benchmark never reached the server")
        assert victims(app).finish() == {"v1": "complete", "chat": "complete"}
        assert runner.is_alive(), "the benchmark ended before the replies were sent"
        runner.join(300)
    finally:
        fake.mode = "ok"
        page.close()
    outcome = done.get("outcome")
    assert outcome is not None and outcome.status == 200, outcome
    # Every stream served, none refused, one at a time (the row's last column).
    assert re.search(r"\| 32 \| 32 \| 0 \|[^\\]*\| 1 \|", outcome.message), outcome
