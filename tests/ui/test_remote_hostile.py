"""The model-server front end (RemoteEngine, in process) against a server that misbehaves on
purpose to hold places or memory: trickled bytes, endless lines, huge events and bodies, a
reply past max_tokens, its key quoted back, a lone surrogate, a health answer that never
ends. Each case: the plain message,
the place freed and the connection closed, the next reply working, and an innocent reply
beside it completing."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from model_utils.backends.errors import BackendError, BackendRejected, BackendTimeout
from model_utils.backends.openai_client import ServerConfig
from model_utils.backends.redaction import REDACTED
from model_utils.backends.remote import RemoteEngine
from model_utils.backends.sse import MAX_EVENT_BYTES, MAX_LINE_BYTES
from model_utils.runtime.generation_settings import GenerationSettings

from .fake_model_server import FakeModelServer
from .test_remote_faults import HELLO, engine_for

KEY = "sk-fake"


@pytest.fixture()
def server():
    fake = FakeModelServer(key=KEY).start()
    yield fake
    fake.stop()


def hostile(mode: str) -> list[dict]:
    return [{"role": "user", "content": f"fake-mode: {mode}"}]


class Innocent:
    """Another user's reply, streaming while the hostile one runs."""

    def __init__(self, engine):
        self.result = None
        self.thread = threading.Thread(target=self._run, args=(engine,), daemon=True)
        self.thread.start()

    def _run(self, engine) -> None:
        try:
            self.result = engine.generate_text(HELLO).answer
        except Exception as error:  # noqa: BLE001 - reported as the result
            self.result = repr(error)

    def finish(self) -> str:
        self.thread.join(20)
        return self.result


def served_again(engine) -> bool:
    return engine.queue_status()["active"] == 0 and \
        engine.generate_text(HELLO).answer == "Hello there."


def test_a_line_trickled_byte_by_byte_is_cut_after_the_read_timeout(server):
    """One byte every 0.2 s, never a newline: each read brings something, so httpx's own read
    timeout never fires; the watcher counts lines and hangs up after 1 s without one."""
    remote = engine_for(server.url, read_timeout_s=1.0, reply_timeout_s=30.0)
    try:
        innocent = Innocent(remote)
        start = time.monotonic()
        with pytest.raises(BackendTimeout, match="sent nothing for 1 s"):
            remote.generate_text(hostile("byte_trickle"))
        assert time.monotonic() - start < 4  # the server would trickle for 60 s
        assert server.hung_up.wait(5), "the connection stayed open"
        assert innocent.finish() == "Hello there."
        assert served_again(remote)
    finally:
        remote.close()


def test_headers_trickled_byte_by_byte_are_cut_after_the_read_timeout(server):
    """The status line, then a header one byte every 0.2 s: httpx's read timeout restarts
    with each byte; the header watch hangs up once the headers have taken 1 s."""
    remote = engine_for(server.url, read_timeout_s=1.0, reply_timeout_s=30.0)
    try:
        innocent = Innocent(remote)
        start = time.monotonic()
        with pytest.raises(BackendTimeout, match="no complete answer headers for 1 s"):
            remote.generate_text(hostile("header_trickle"))
        assert time.monotonic() - start < 4  # the server would trickle for 60 s
        assert server.hung_up.wait(5), "the connection stayed open"
        assert innocent.finish() == "Hello there."
        assert served_again(remote)
        header_trickles = [b for b in server.bodies if "header_trickle" in str(b["messages"])]
        assert len(header_trickles) == 1  # not sent again after the hang-up
    finally:
        remote.close()


def test_the_reply_deadline_holds_mid_line(server):
    remote = engine_for(server.url, read_timeout_s=20.0, reply_timeout_s=1.5)
    try:
        start = time.monotonic()
        with pytest.raises(BackendTimeout, match="longer than 1.5 s"):
            remote.generate_text(hostile("byte_trickle"))
        assert time.monotonic() - start < 5  # not the 20 s read timeout, not the 60 s trickle
        assert server.hung_up.wait(5)
        assert served_again(remote)
    finally:
        remote.close()


@pytest.mark.parametrize(("mode", "words"), [
    ("long_line", f"a line of more than {MAX_LINE_BYTES // 1024} KB"),
    ("huge_event", f"an event larger than {MAX_EVENT_BYTES // 1024} KB"),
])
def test_an_oversized_line_or_event_is_refused_unread(engine, server, mode, words):
    innocent = Innocent(engine)
    with pytest.raises(BackendError, match=words) as raised:
        engine.generate_text(hostile(mode))
    assert raised.value.http_status == 502
    if mode == "long_line":  # 64 MB on offer: the client hung up near the cap
        assert server.hung_up.wait(5)
        assert server.sent < 16 << 20, f"{server.sent} bytes were read"
    assert innocent.finish() == "Hello there."
    assert served_again(engine)


def test_a_reasoning_flood_is_cut_at_max_tokens_counted_here(engine, server):
    innocent = Innocent(engine)
    final = engine.generate_text(hostile("reasoning_flood"),
                                 GenerationSettings(max_new_tokens=16))
    # The innocent reply's request may reach the server before or after this one.
    flood = [body for body in server.bodies if "reasoning_flood" in str(body["messages"])]
    assert [body["max_tokens"] for body in flood] == [16]
    assert final.stats.finish_reason == "length"
    assert "past max_tokens (16)" in final.notice
    assert final.reasoning.split() == ["hmm"] * 16 and final.answer == ""
    assert server.hung_up.wait(5), "the server was still writing"
    assert innocent.finish() == "Hello there."
    assert served_again(engine)


def test_without_max_tokens_a_flood_stops_at_the_context(engine, server):
    final = engine.generate_text(hostile("reasoning_flood"))
    assert final.stats.finish_reason == "length"
    assert len(final.reasoning.split()) == 4096  # the fake's max_model_len
    assert server.hung_up.wait(5)


def test_a_lone_surrogate_becomes_a_replacement_character(engine, server):
    final = engine.generate_text(hostile("surrogate"))
    assert final.answer == "a\ufffdb" and final.stats.finish_reason == "eos"
    final.answer.encode("utf-8")  # what this app sends on can be encoded


def test_the_key_quoted_back_is_redacted_everywhere(engine, server, caplog):
    caplog.set_level(logging.INFO)
    with pytest.raises(BackendRejected) as refused:
        engine.generate_text(hostile("400_key"))
    assert KEY not in str(refused.value) and f"Bearer {REDACTED}" in str(refused.value)
    final = engine.generate_text(hostile("error_event_key"))
    assert final.answer == "Hello" and final.stats.finish_reason == "error"
    assert KEY not in final.notice and REDACTED in final.notice
    server.models_mode = "500_key"
    health = engine.monitor.check_now()
    assert not health.ok and KEY not in health.error and REDACTED in health.error
    assert KEY not in repr(engine.status())
    assert KEY not in caplog.text
    server.models_mode = "ok"
    assert served_again(engine)


def test_a_huge_models_error_body_is_not_read(engine, server):
    server.models_mode = "huge_error"
    health = engine.monitor.check_now()
    assert not health.ok and "HTTP 500" in health.error
    assert server.hung_up.wait(5)
    assert server.sent < 32 << 20, f"{server.sent} of 64 MB were read"
    server.models_mode = "ok"
    assert engine.monitor.check_now().ok
    assert served_again(engine)


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_trickled_models_answer_is_cut_at_its_wall_clock_bound(server):
    """/models (and /get_model_info) one byte a second, never finishing: each read brings a
    byte, so no read timeout fires; the whole answer is bounded (2 s here). While the
    health thread is in such a check, replies and status() answer; the checks go on, and
    find the server again once it answers."""
    config = ServerConfig(server.url, key=KEY, connect_timeout_s=2.0, read_timeout_s=5.0)
    remote = RemoteEngine(config, max_batch=2, max_queue=0, health_interval_s=0.5,
                          health_retry_s=0.2, health_timeout_s=2.0)
    try:
        assert remote.monitor.health.ok
        server.models_mode = "trickle"
        start = time.monotonic()
        health = remote.monitor.check_now()
        assert time.monotonic() - start < 6  # the server would trickle for 60 s
        assert not health.ok and "/models answer took longer than 2 s" in health.error
        assert server.hung_up.wait(5), "the connection stayed open"
        asked = server.models_asked
        wait_until(lambda: server.models_asked > asked, 5, "no check after the cut one")
        # A check is trickling now: neither a reply nor the status waits for it.
        innocent = Innocent(remote)
        start = time.monotonic()
        assert remote.status()["backend_url"] == server.url
        assert time.monotonic() - start < 1.5
        assert innocent.finish() == "Hello there."
        start = time.monotonic()  # the sliders' defaults: that answer is bounded too
        assert remote.default_settings().as_dict()["temperature"] is None
        assert time.monotonic() - start < 6
        wait_until(lambda: server.models_asked > asked + 2, 15, "the checks stopped")
        server.models_mode = "ok"
        wait_until(lambda: remote.monitor.health.ok, 10, "the server was not seen again")
        assert served_again(remote)
    finally:
        remote.close()


def test_settings_left_unset_are_not_sent_so_the_server_applies_its_own(engine, server):
    """vLLM reports no sampling defaults but applies the model's generation_config to the
    fields a request leaves out: unset ones are left out, set ones are sent as given."""
    assert engine.default_settings().as_dict()["temperature"] is None  # none reported
    assert engine.generate_text(HELLO, GenerationSettings()).answer == "Hello there."
    body = server.bodies[-1]
    assert not {"temperature", "top_p", "top_k", "repetition_penalty"} & set(body), body
    engine.generate_text(HELLO, GenerationSettings(temperature=0.3, top_p=0.8))
    assert (server.bodies[-1]["temperature"], server.bodies[-1]["top_p"]) == (0.3, 0.8)
    assert "top_k" not in server.bodies[-1]


@pytest.fixture()
def engine(server):
    remote = engine_for(server.url)
    yield remote
    remote.close()
