"""The app with the local engine (the demo model's shape with random weights, on the CPU: its
replies go on for thousands of tokens) and few places (--max-batch 4 --max-queue 1): a gradio
client that leaves mid-reply frees its place at once, and the admin's Benchmark leaves room
for other users' chats."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import pytest
from gradio_client import Client

from .attacks import chat_stream, page_handler, page_login

ADMIN, GUEST = ("ann", "ann-secret"), ("bob", "bob-secret")
BEARER = f"Bearer {GUEST[0]}:{GUEST[1]}"
ROWS = 4  # and one place to wait in: 5 places, of which the benchmark takes 3 at most


@pytest.fixture(scope="module")
def app(start_random_demo):
    return start_random_demo("--model", "demo", "--mode", "fp32", "--placement", "cpu",
                             "--auth", ":".join(ADMIN), "--auth", ":".join(GUEST),
                             "--admin", ADMIN[0], "--max-batch", str(ROWS), "--max-queue", "1")


@pytest.fixture(scope="module")
def guest(app):
    return Client(app.url, auth=GUEST, verbose=False)


def queue(client: Client) -> dict:
    return client.predict(api_name="/status")["queue"]


def wait_until(condition, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, what
        time.sleep(0.05)
    return time.monotonic() - start


def long_reply(app) -> socket.socket:
    """A /v1 reply of thousands of tokens holding a row until its socket is closed (greedy:
    the same tokens every run, none of them the end)."""
    body = json.dumps({"messages": [{"role": "user", "content": "Tell me about the sea."}],
                       "max_tokens": 4000, "temperature": 0, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", app.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nAuthorization: " + BEARER.encode() +
                 f"\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def test_a_gradio_client_waiting_for_a_row_that_leaves_frees_its_place(app, guest):
    """Every row decoding other replies: a /chat client's reply waits for one, so nothing
    reaches its event stream and gradio alone noticed it leave only 10-15 s later. It
    closes its stream: its waiting place is free within seconds."""
    page = page_login(app.url, *GUEST)
    rows = [long_reply(app) for _ in range(ROWS)]
    try:
        wait_until(lambda: queue(guest)["active"] == ROWS, 60, "the long replies never started")
        with chat_stream(page, "Hello?", {"max_new_tokens": 64}):
            wait_until(lambda: queue(guest)["waiting"] == 1, 30, "the reply never queued")
        freed = wait_until(lambda: queue(guest)["waiting"] == 0, 10, "the place was kept")
        print(f"waiting place freed {freed:.2f} s after the client left")
        assert freed < 8, f"freed after {freed:.2f} s"  # gradio alone: 10 s or more
        assert queue(guest)["active"] == ROWS  # the other replies go on
    finally:
        for sock in rows:
            sock.close()
        page.close()
    wait_until(lambda: queue(guest)["active"] == 0, 10, "the long replies kept their rows")


def test_a_gradio_client_that_leaves_a_streaming_reply_frees_its_row(app, guest):
    page = page_login(app.url, *GUEST)
    try:
        with chat_stream(page, "Hello?", {"max_new_tokens": 4000, "temperature": 0}):
            wait_until(lambda: queue(guest)["active"] == 1, 60, "the reply never started")
        freed = wait_until(lambda: queue(guest)["active"] == 0, 10, "the row was kept")
        assert freed < 8, f"freed after {freed:.2f} s"
    finally:
        page.close()


def test_a_chat_during_the_admins_4_request_benchmark_completes(app, guest):
    """5 places: the benchmark's 4 concurrent requests run at most 3 at once (two places
    stay for other users), so a chat sent while they run is admitted and completes, and the
    benchmark itself ends with its table."""
    page = page_login(app.url, *ADMIN)
    done: dict = {}
    runner = threading.Thread(target=lambda: done.update(outcome=page_handler(
        page, "run", {0: 8, 1: 128, 2: [str(ROWS)]})), daemon=True)
    try:
        runner.start()
        seen = []

        def sampled() -> dict:
            now = queue(guest)
            seen.append(now["active"] + now["waiting"])
            return now

        wait_until(lambda: sampled()["active"] > 0, 120, "the benchmark never decoded")
        # Its requests, before any chat of ours: until it holds its 3 places (or 3 s), so
        # that the chat goes out while the benchmark runs, however fast this machine is.
        until = time.monotonic() + 3
        while time.monotonic() < until and runner.is_alive() and max(seen) < 3:
            sampled()
        assert max(seen) <= 3, f"the benchmark took {max(seen)} of 5 places"
        assert runner.is_alive(), "the benchmark ended before the chat was sent"
        final = None
        for final in guest.submit("Hello?", [], {"max_new_tokens": 16}, "", False,
                                  api_name="/chat"):
            pass
        assert final is not None and final["done"] and final["stats"]["new_tokens"] > 0
        runner.join(300)
    finally:
        page.close()
    outcome = done.get("outcome")
    assert outcome is not None and outcome.status == 200, outcome
    assert "ran at most 3 at once" in outcome.message, outcome


def test_the_benchmarks_4_requests_never_decode_together(app):
    """The engine's own count of the replies decoded in one step during the benchmark's timed
    4-request run (no chat beside it, which would join that step): 3 at most, not all 4."""
    page = page_login(app.url, *ADMIN)
    try:
        logged = len(app.log())
        outcome = page_handler(page, "run", {0: 8, 1: 32, 2: [str(ROWS)]})
    finally:
        page.close()
    assert outcome.status == 200, outcome
    together = [int(n) for n in re.findall(r"batch 4: .* at most (\d+) replies per step",
                                           app.log()[logged:])]
    assert together and max(together) <= 3, together
