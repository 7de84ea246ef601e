"""This app in front of another instance of itself: the backend serves the demo model with its
own login, the front has --backend, the backend's key in a file, and logins of its own. Both
are real servers (python app.py) on loopback; every request is bounded in time."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

from model_utils.backends.errors import BackendError
from model_utils.backends.openai_client import ServerConfig
from model_utils.backends.remote import RemoteEngine

from .test_remote_faults import wait_for_v1

BACKEND_LOGIN = "svc:backend-secret-7"
FRONT_USER, ADMIN = ("ann", "pw1"), ("root", "pw2")
MESSAGES = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Tell me about the sea."}]
GREEDY = {"temperature": 0, "max_tokens": 24, "enable_thinking": False}


@pytest.fixture(scope="module")
def backend(start_random_demo):
    # One reply at a time and no queue: a held slot shows as "busy" and in its queue. Random
    # weights under the demo's name: a long reply lasts long enough to be seen and stopped.
    return start_random_demo("--model", "demo", "--mode", "fp32", "--placement", "cpu",
                     "--max-batch", "1", "--max-queue", "0", "--auth", BACKEND_LOGIN)


@pytest.fixture(scope="module")
def front(start_app, backend, tmp_path_factory):
    key = tmp_path_factory.mktemp("key") / "backend.key"
    key.write_text(BACKEND_LOGIN + "\n")
    return start_app("--backend", backend.url + "/v1", "--backend-key-file", str(key),
                     "--auth", ":".join(FRONT_USER), "--auth", ":".join(ADMIN),
                     "--admin", ADMIN[0])


def bearer(login: str) -> dict:
    return {"Authorization": f"Bearer {login}"}


@pytest.fixture(scope="module")
def http(front, backend):
    for app, login in ((front, ":".join(FRONT_USER)), (backend, BACKEND_LOGIN)):
        with httpx.Client(base_url=app.url, timeout=30) as client:
            wait_for_v1(client, bearer(login))
    with httpx.Client(timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def backend_status(backend):
    """The backend's /status through one client connected once: a look at its queue then
    takes one request, well within the seconds a long reply of the demo model lasts."""
    client = Client(backend.url, auth=tuple(BACKEND_LOGIN.split(":")), verbose=False)
    return lambda: client.predict(api_name="/status")


def wait_until_free(backend_status) -> None:
    deadline = time.monotonic() + 30
    while backend_status()["queue"]["active"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert backend_status()["queue"]["active"] == 0


def streamed_text(response: httpx.Response) -> str:
    text = ""
    for line in response.iter_lines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                text += choice["delta"].get("content") or ""
    return text


def test_text_completions_in_front_of_a_model_server_are_refused_plainly(http, front):
    response = http.post(front.url + "/v1/completions", headers=bearer(":".join(FRONT_USER)),
                         json={"prompt": "Hello", "max_tokens": 4})
    assert response.status_code == 501
    message = response.json()["error"]["message"]
    assert "chat completions endpoint" in message and "Traceback" not in message


def test_greedy_replies_through_the_front_equal_the_backends(http, front, backend):
    direct = http.post(backend.url + "/v1/chat/completions", headers=bearer(BACKEND_LOGIN),
                       json={"messages": MESSAGES, **GREEDY}).json()
    expected = direct["choices"][0]["message"]["content"]
    assert direct["usage"]["completion_tokens"] == 24
    user = bearer(":".join(FRONT_USER))
    whole = http.post(front.url + "/v1/chat/completions", headers=user,
                      json={"messages": MESSAGES, **GREEDY}).json()
    assert whole["choices"][0]["message"]["content"] == expected
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [whole["usage"][k] for k in counts] == [direct["usage"][k] for k in counts]
    assert whole["model"] == direct["model"]
    assert whole["usage"]["prompt_tokens_details"] == direct["usage"]["prompt_tokens_details"]
    with http.stream("POST", front.url + "/v1/chat/completions", headers=user,
                     json={"messages": MESSAGES, **GREEDY, "stream": True}) as response:
        assert response.status_code == 200
        assert streamed_text(response) == expected
    client = Client(front.url, auth=FRONT_USER, verbose=False)
    final = client.predict(MESSAGES[1]["content"], [], {"temperature": 0, "max_new_tokens": 24},
                           MESSAGES[0]["content"], False, api_name="/chat")
    assert final["answer"] == expected
    # Measured here: time to first token and tokens/s of the stream through the front.
    stats = final["stats"]
    assert stats["new_tokens"] == 24 and stats["ttft_ms"] > 0 and stats["tok_s"] > 0
    assert "remote" in stats["line"]
    streamed = [u["answer"] for u in client.submit(
        MESSAGES[1]["content"], [], {"temperature": 0, "max_new_tokens": 24},
        MESSAGES[0]["content"], False, api_name="/chat")]
    assert streamed[-1] == expected


def test_the_openai_client_through_the_front(http, front, backend):
    """The official client, with a front login as its key, streamed and not."""
    from openai import OpenAI

    direct = http.post(backend.url + "/v1/chat/completions", headers=bearer(BACKEND_LOGIN),
                       json={"messages": MESSAGES, **GREEDY}).json()
    client = OpenAI(base_url=front.url + "/v1", api_key=":".join(FRONT_USER), max_retries=0,
                    timeout=120)
    assert [m.id for m in client.models.list()] == [direct["model"]]
    options = {"model": direct["model"], "messages": MESSAGES, "max_tokens": 24,
               "temperature": 0, "extra_body": {"chat_template_kwargs":
                                                {"enable_thinking": False}}}
    reply = client.chat.completions.create(**options)
    assert reply.choices[0].message.content == direct["choices"][0]["message"]["content"]
    assert reply.usage.completion_tokens == 24
    text = "".join(chunk.choices[0].delta.content or "" for chunk in
                   client.chat.completions.create(**options, stream=True) if chunk.choices)
    assert text == direct["choices"][0]["message"]["content"]


def test_closing_a_stream_at_the_front_frees_the_backends_slot(http, front, backend,
                                                               backend_status):
    user = bearer(":".join(FRONT_USER))
    long = {"messages": MESSAGES, "temperature": 0, "max_tokens": 4000, "stream": True}
    with http.stream("POST", front.url + "/v1/chat/completions", headers=user,
                     json=long) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if '"content": "' in line and '""' not in line)
        assert backend_status()["queue"]["active"] == 1
        # The backend's one place is taken: "busy" from it, passed on by the front.
        busy = http.post(front.url + "/v1/chat/completions", headers=user,
                         json={"messages": MESSAGES, **GREEDY})
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert "busy" in busy.json()["error"]["message"]
    wait_until_free(backend_status)
    ok = http.post(backend.url + "/v1/chat/completions", headers=bearer(BACKEND_LOGIN),
                   json={"messages": MESSAGES, **GREEDY})
    assert ok.status_code == 200


def test_a_cancelled_gradio_reply_frees_the_backends_slot(front, backend_status):
    client = Client(front.url, auth=FRONT_USER, verbose=False)
    job = client.submit("Tell me everything.", [], {"temperature": 0, "max_new_tokens": 4000},
                        "", False, api_name="/chat")
    deadline = time.monotonic() + 60
    while not job.outputs() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert job.outputs(), "no streamed update within 60 s"
    assert backend_status()["queue"]["active"] == 1
    job.cancel()
    wait_until_free(backend_status)


def test_logins_on_both_sides(http, front, backend):
    body = {"messages": MESSAGES, **GREEDY}
    # The front wants its own login, never the backend's key ...
    assert http.post(front.url + "/v1/chat/completions", json=body).status_code == 401
    assert http.post(front.url + "/v1/chat/completions", headers=bearer(BACKEND_LOGIN),
                     json=body).status_code == 401
    # ... and the backend wants its own.
    assert http.post(backend.url + "/v1/chat/completions", json=body).status_code == 401
    # A front with a wrong key is told so, in words an operator can act on.
    wrong = RemoteEngine(ServerConfig(backend.url + "/v1", key="svc:wrong"),
                         start_health=False)
    try:
        with pytest.raises(BackendError, match="refused this app's credentials"):
            wrong.generate_text(MESSAGES[1:])
    finally:
        wrong.close()


def test_the_key_is_never_shown_logged_or_in_status(http, front):
    secret = BACKEND_LOGIN.split(":")[1]
    status = Client(front.url, auth=FRONT_USER, verbose=False).predict(api_name="/status")
    assert status["remote"] and status["health"]["ok"] and status["backend_url"].endswith("/v1")
    assert secret not in json.dumps(status)
    login = http.post(front.url + "/login", data={"username": FRONT_USER[0],
                                                  "password": FRONT_USER[1]})
    assert login.status_code == 200
    page = http.get(front.url + "/config", cookies=login.cookies)
    assert page.status_code == 200 and "Model server" in page.text
    assert secret not in page.text
    assert secret not in front.log() and secret not in front.output()


def test_models_are_the_servers_business(front):
    admin = Client(front.url, auth=ADMIN, verbose=False)
    with pytest.raises(AppError, match="models, modes and placements are chosen there"):
        admin.predict("demo", "nf4", "cpu", api_name="/load_model")
    with pytest.raises(AppError, match="chosen there"):
        admin.predict(api_name="/unload_model")
    # --admin still rules in front of a server: another user is refused for that reason.
    with pytest.raises(AppError, match="only the admin user"):
        Client(front.url, auth=FRONT_USER, verbose=False).predict(api_name="/unload_model")


def test_the_page_in_front_of_a_server(front, backend, artifacts):
    """A browser on the front: a reply streams from the backend with its stats line, and the
    Model, Memory and Benchmark tabs describe the server, not a local model. (Stop on the
    page: test_remote_faults, against a server whose reply lasts as long as the test needs.)"""
    from .browser import open_browser, set_number

    with open_browser() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(30000)
        page.goto(front.url)
        page.get_by_label("username").fill(FRONT_USER[0])
        page.get_by_label("password").fill(FRONT_USER[1])
        page.get_by_role("button", name="Login").click()
        page.locator("#headline").get_by_text("remote").wait_for()
        assert backend.url in page.locator("#headline").inner_text()
        for label, value in (("max_new_tokens", "48"), ("temperature", "0")):
            set_number(page, label, value)
        page.locator("#message textarea").fill("Write a very long story.")
        page.locator("#message textarea").press("Enter")
        stats = page.locator("#chatbot sub", has_text="/ 48 out")
        stats.wait_for(timeout=60000)
        assert "remote" in stats.inner_text() and "hit max_new_tokens" in stats.inner_text()
        page.get_by_role("tab", name="Model").click()
        server = page.locator("#remote-server")
        server.get_by_text("up").first.wait_for()
        text = server.inner_text()
        assert backend.url + "/v1" in text and "Models it serves: demo" in text
        assert "the model server's business" in text and "backend-secret" not in text
        page.screenshot(path=str(artifacts / "remote-model-tab.png"))
        page.get_by_role("tab", name="Memory").click()
        page.locator("#remote-memory").get_by_text("GPU memory is the server's business")\
            .wait_for()
        # The Benchmark tab: for the admin only (its streams take every user's places).
        page.get_by_role("tab", name="Benchmark").click()
        assert page.locator("#remote-bench-run").is_disabled()
        assert f"Only the admin user ({ADMIN[0]})" in \
            page.locator("#remote-bench-note").inner_text().replace("**", "")
        # The admin measures through the server (one stream: the backend has one place).
        page = browser.new_context().new_page()
        page.set_default_timeout(30000)
        page.goto(front.url)
        page.get_by_label("username").fill(ADMIN[0])
        page.get_by_label("password").fill(ADMIN[1])
        page.get_by_role("button", name="Login").click()
        page.get_by_role("tab", name="Benchmark").click()
        page.get_by_role("checkbox", name="8").uncheck()
        page.locator("#remote-bench-run").click()
        table = page.locator("#remote-bench-table")
        table.get_by_text("tok/s all streams").wait_for(timeout=60000)
        row = table.locator("tbody tr").first.inner_text().split("\t")
        assert row[:3] == ["1", "1", "0"], row  # 1 stream, 1 reply, no error
