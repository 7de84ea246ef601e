"""The hardening catalogue: bad requests against the real app, each beside other users' replies.

Every case sends one bad request (OpenAI API, gradio's named endpoints, raw HTTP, the page's
own handlers by fn_index; as a guest or as the admin) while two innocent replies stream (one
through /v1, one through /chat), and asserts: a 4xx (or a gradio error) whose message is plain
(names what to change, no exception, no HTML entities, no server path for a guest), the server
still answering, the loaded model unchanged (not even unloaded and loaded again), and both
innocent replies complete.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
from gradio_client import Client

from model_utils.bench.per_mode import LOADED_LIMITS
from model_utils.loading.demo_model import DEMO_LABEL, demo_model_path

from .attacks import (
    PROMPT,
    Outcome,
    Victims,
    by_route,
    named,
    page_handler,
    page_login,
    plain_problems,
    raw_post,
    train,
    v1,
)

ADMIN, GUEST = ("ann", "ann-secret"), ("bob", "bob-secret")
BEARER = {"Authorization": f"Bearer {GUEST[0]}:{GUEST[1]}"}
OK = {"messages": PROMPT, "max_tokens": 8}


def deep(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    """A models folder: a copy of the demo model, one with pickle weights only, and one whose
    safetensors file is a symlink to a file outside every allowed folder."""
    root = tmp_path_factory.mktemp("models")
    demo = demo_model_path()
    shutil.copytree(demo, root / "demo-copy")
    for name in ("pickle-only", "linked"):
        (root / name).mkdir()
        for file in demo.iterdir():
            if file.name != "model.safetensors":
                shutil.copy(file, root / name / file.name)
    (root / "pickle-only" / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    outside = tmp_path_factory.mktemp("outside")  # under no allowed root
    shutil.copy(demo / "model.safetensors", outside / "model.safetensors")
    (root / "linked" / "model.safetensors").symlink_to(outside / "model.safetensors")
    (root / "deep.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    (root / "bigint.jsonl").write_text('{"messages": ' + "1" * 5000 + "}\n")
    return root


@pytest.fixture(scope="module")
def app(start_app, models_dir):
    return start_app("--model", "demo", "--mode", "fp32", "--placement", "cpu",
                     "--auth", ":".join(ADMIN), "--auth", ":".join(GUEST), "--admin", ADMIN[0],
                     "--models-dir", str(models_dir), "--max-batch", "4", "--max-queue", "8")


@pytest.fixture(scope="module")
def loopback(start_app):
    return start_app("--model", "demo", "--mode", "fp32", "--placement", "cpu",
                     "--max-batch", "4", "--max-queue", "8")


@dataclass
class Side:
    """One app as the catalogue sees it: its clients and what "unchanged" means."""

    url: str
    v1: httpx.Client
    guest: Client
    admin: Client
    page: httpx.Client
    victim_headers: dict
    log: object
    # The other users' gradio client (tests/ui/attacks.py's Victims): its own, because one
    # gradio_client.Client reads every job through one event stream, and a job ending there
    # as another starts could lose the other's result (seen once: CancelledError).
    victim: Client | None = None
    models: object = None  # the models folder (the app with logins)
    admin_page: httpx.Client | None = None  # the page as the admin (the app with logins)

    def model(self) -> tuple:
        status = self.admin.predict(api_name="/status")
        return status.get("model"), status.get("mode"), status.get("model_path"), \
            status.get("load_s")


@pytest.fixture(scope="module")
def side(app, models_dir):
    page, admin_page = page_login(app.url, *GUEST), page_login(app.url, *ADMIN)
    with httpx.Client(base_url=app.url, timeout=300, headers=BEARER) as http:
        yield Side(app.url, http, Client(app.url, auth=GUEST, verbose=False),
                   Client(app.url, auth=ADMIN, verbose=False), page, BEARER, app.log,
                   Client(app.url, auth=GUEST, verbose=False), models_dir, admin_page)
    page.close()
    admin_page.close()


@pytest.fixture(scope="module")
def open_side(loopback):
    with httpx.Client(base_url=loopback.url, timeout=300) as http:
        client = Client(loopback.url, verbose=False)
        yield Side(loopback.url, http, client, client, http, {}, loopback.log,
                   Client(loopback.url, verbose=False))


def guest_paths(side: Side, models_dir) -> tuple[str, ...]:
    return (str(models_dir), str(demo_model_path().parent), "/root/", "/tmp/")


# -- the cases: (id, who sends it, the attack, what the refusal must say) ------------------------
# who: "guest" / "admin" (the app with logins), "open" (the app without logins).
# expect: (status, words): status an int, "AppError", "error", or "any" where the engine may
# serve the request instead (a temperature below its epsilon is greedy); words must appear.
V1 = [
    ("v1-lone-surrogate", lambda s: v1(s.v1, raw=b'{"messages": [{"role": "user", '
                                       b'"content": "\\ud800"}]}'), (400, "not JSON")),
    ("v1-100000-nested-brackets", lambda s: v1(s.v1, raw=deep(100_000)),
     (400, "recursion limit")),
    ("v1-nested-content", lambda s: v1(s.v1, raw=b'{"messages": [{"role": "user", "content": '
                                       + deep(5000) + b"}]}"), (400, "recursion limit")),
    ("v1-not-json", lambda s: v1(s.v1, raw=b"{not json"), (400, "not JSON")),
    ("v1-body-is-a-list", lambda s: v1(s.v1, raw=b"[]"), (400, "JSON object")),
    ("v1-17-mb-body", lambda s: v1(s.v1, raw=b'"' + b"x" * (17 * 2**20) + b'"'),
     (413, "larger than")),
    ("v1-content-is-a-number", lambda s: v1(s.v1, {"messages": [{"role": "user",
                                                                 "content": 5}]}),
     (400, "messages.0.content")),
    ("v1-image-part", lambda s: v1(s.v1, {"messages": [{"role": "user", "content": [
        {"type": "<img src=x>", "text": "x"}]}]}),
     (400, "only text parts are supported (got '<img src=x>')")),
    ("v1-unknown-role", lambda s: v1(s.v1, {"messages": [{"role": "robot", "content": "x"}]}),
     (400, "role")),
    ("v1-late-system", lambda s: v1(s.v1, {"messages": [*PROMPT, {"role": "system",
                                                                  "content": "x"}, *PROMPT]}),
     (400, "may only come first")),
    ("v1-no-messages", lambda s: v1(s.v1, {"messages": []}), (400, "messages")),
    ("v1-ends-with-assistant", lambda s: v1(s.v1, {"messages": [
        *PROMPT, {"role": "assistant", "content": "x"}]}), (400, "end with a user message")),
    ("v1-empty-message", lambda s: v1(s.v1, {"messages": [{"role": "user", "content": " "}]}),
     (400, "is empty")),
    ("v1-temperature-a-string", lambda s: v1(s.v1, {**OK, "temperature": "hot"}),
     (400, "temperature")),
    ("v1-temperature-negative", lambda s: v1(s.v1, {**OK, "temperature": -1}),
     (400, "temperature")),
    ("v1-temperature-nan", lambda s: v1(s.v1, raw=b'{"messages": [{"role": "user", '
                                        b'"content": "hi"}], "temperature": NaN}'),
     (400, "not JSON")),
    ("v1-top-p-zero", lambda s: v1(s.v1, {**OK, "top_p": 0}), (400, "top_p")),
    ("v1-max-tokens-zero", lambda s: v1(s.v1, {**OK, "max_tokens": 0}), (400, "max_tokens")),
    ("v1-seed-a-string", lambda s: v1(s.v1, {**OK, "seed": "x"}), (400, "seed")),
    ("v1-n-3", lambda s: v1(s.v1, {**OK, "n": 3}), (400, "n=1")),
    ("v1-17-stop-strings", lambda s: v1(s.v1, {**OK, "stop": ["x"] * 17}),
     (400, "at most 16")),
    ("v1-stream-a-string", lambda s: v1(s.v1, {**OK, "stream": "yes"}), (400, "stream")),
    ("v1-2001-messages", lambda s: v1(s.v1, {"messages": [
        {"role": "user" if i % 2 == 0 else "assistant", "content": "hi"}
        for i in range(2001)]}), (400, "at most 2000")),
    ("v1-message-beyond-the-context", lambda s: v1(s.v1, {"messages": [
        {"role": "user", "content": "word " * 20000}]}), (400, "context window")),
    ("v1-wrong-login", lambda s: v1(s.v1, OK, headers={"Authorization": "Bearer bob:nope"}),
     (401, "login is required")),
    # The sampler's limits: refused at the door, or served (a tiny temperature is greedy).
    ("v1-temperature-1e-300", lambda s: v1(s.v1, {**OK, "temperature": 1e-300}), ("any", "")),
    ("v1-temperature-2.28e-39", lambda s: v1(s.v1, {**OK, "temperature": 2.28e-39}),
     ("any", "")),
    ("v1-repetition-penalty-1e-300", lambda s: v1(s.v1, {**OK, "repetition_penalty": 1e-300}),
     ("any", "")),
    ("v1-seed-2**70", lambda s: v1(s.v1, {**OK, "seed": 2**70}), (400, "seed")),
]

def nested_versions(levels: int) -> list[dict]:
    """A history whose versions hold versions, `levels` deep."""
    history = [{"role": "user", "content": "x"}]
    for _ in range(levels):
        history = [{"role": "user", "content": "y", "branch": 1,
                    "branches": [[{"role": "user", "content": "old"}, *history]]}]
    return history


NAMED = [
    ("chat-lone-surrogate", lambda s: raw_post(s.page, "/gradio_api/call/chat",
                                                b'{"data": ["\\ud800"]}'), (400, "not JSON")),
    ("chat-100000-nested-brackets", lambda s: raw_post(s.page, "/gradio_api/call/chat",
                                                        b'{"data": ' + deep(100_000) + b"}"),
     (400, "recursion limit")),
    ("chat-message-a-number", lambda s: named(s.guest, "/chat", 5), ("AppError", "message")),
    ("chat-system-prompt-a-number", lambda s: named(s.guest, "/chat", "hi", [], None, 123),
     ("AppError", "system_prompt")),
    ("chat-settings-a-list", lambda s: named(s.guest, "/chat", "hi", [], [1]),
     ("AppError", "settings")),
    ("chat-history-a-string", lambda s: named(s.guest, "/chat", "hi", "x"),
     ("AppError", "history must be a list")),
    ("chat-thinking-a-string", lambda s: named(s.guest, "/chat", "hi", [], None, "", "yes"),
     ("AppError", "thinking")),
    ("chat-unknown-setting-with-markup", lambda s: named(s.guest, "/chat", "hi", [],
                                                          {"<b>x</b>": 1}),
     ("AppError", "unknown setting(s) <b>x</b>")),
    ("chat-temperature-a-string", lambda s: named(s.guest, "/chat", "hi", [],
                                                  {"temperature": "hot"}),
     ("AppError", "temperature")),
    ("chat-2001-messages", lambda s: named(s.guest, "/chat", "hi", [
        {"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(2001)]),
     ("AppError", "at most 2000")),
    ("chat-seed-2**70", lambda s: named(s.guest, "/chat", "hi", [], {"seed": 2**70}),
     ("AppError", "seed")),
    # A history's versions of a message (the chat page's branches): checked, bounded.
    ("chat-branches-of-another-role", lambda s: named(s.guest, "/chat", "hi", [
        {"role": "user", "content": "a", "branch": 1,
         "branches": [[{"role": "assistant", "content": "b"}]]},
        {"role": "assistant", "content": "c"}]),
     ("AppError", "a version of a user message must be a user message")),
    ("count-branches-nested-60-deep", lambda s: named(s.guest, "/count_tokens", "hi",
                                                       nested_versions(60)),
     ("AppError", "versions nested more than 50 deep")),
    ("count-history-a-string", lambda s: named(s.guest, "/count_tokens", "hi", "x"),
     ("AppError", "history must be a list")),
    ("count-settings-a-list", lambda s: named(s.guest, "/count_tokens", "hi", [], [1]),
     ("AppError", "settings")),
    ("load-as-guest", lambda s: named(s.guest, "/load_model", "demo", "bf16", "cpu"),
     ("AppError", "only the admin")),
    ("load-as-guest-bad-types", lambda s: named(s.guest, "/load_model", 123, "bf16", "cpu",
                                                [1, 2]), ("AppError", "only the admin")),
    ("unload-as-guest", lambda s: named(s.guest, "/unload_model"),
     ("AppError", "only the admin")),
    ("page-load-as-guest", lambda s: page_handler(s.page, "load", {0: DEMO_LABEL, 2: "bf16"}),
     (200, "only the admin")),
    ("page-estimate-any-path", lambda s: page_handler(s.page, "estimate", {1: "/etc"}),
     (200, "outside the allowed model folders")),
    ("page-send-with-a-bad-conversation", lambda s: page_handler(s.page, "respond",
                                                                {0: "hi", 1: {"a": 1}}),
     ("error", "history must be a list")),
    ("page-send-with-5000-turns", lambda s: page_handler(s.page, "respond", {0: "hi", 1: [
        {"role": "user" if i % 2 == 0 else "assistant", "content": "hi"}
        for i in range(5000)]}), ("error", "at most 2000")),
]

def bench(page: httpx.Client, prompt_tokens=8, new_tokens=8, batches=("1",)) -> Outcome:
    """The Benchmark tab's Run button (the page's "run" handler, by fn_index), small sizes
    unless told: the sliders' values and the checked numbers of concurrent requests."""
    return page_handler(page, "run", {0: prompt_tokens, 1: new_tokens,
                                      2: list(batches) if isinstance(batches, tuple)
                                      else batches})


ADMIN_ONLY = "only the admin user (ann) may run the benchmark; you are 'bob'"
BENCH_GUEST = [
    ("bench-as-guest", lambda s: bench(s.page), ("error", ADMIN_ONLY)),
    ("bench-as-guest-with-huge-sizes", lambda s: bench(s.page, 10**5, 10**5, ["1000"]),
     ("error", ADMIN_ONLY)),
    ("bench-as-guest-with-a-string-size", lambda s: bench(s.page, "many"),
     ("error", ADMIN_ONLY)),
    ("bench-as-guest-by-route", lambda s: by_route(s.page, "run", [8, 8, ["1"]]),
     ("error", ADMIN_ONLY)),
]

# The admin's benchmark holds the engine every chat uses: its sizes are capped
# (LOADED_LIMITS) and each refusal names the cap or the type it wants.
BENCH_ADMIN = [
    ("bench-100000-new-tokens", lambda s: bench(s.admin_page, new_tokens=100_000),
     ("error", f"new tokens must be between 1 and {LOADED_LIMITS['new_tokens']}")),
    ("bench-100000-prompt-tokens", lambda s: bench(s.admin_page, prompt_tokens=100_000),
     ("error", f"prompt tokens must be between 1 and {LOADED_LIMITS['prompt_tokens']}")),
    ("bench-1000-concurrent-requests", lambda s: bench(s.admin_page, batches=["1000"]),
     ("error", f"concurrent requests must be between 1 and {LOADED_LIMITS['batch']}")),
    ("bench-1000-concurrent-requests-a-number", lambda s: bench(s.admin_page, batches=[1000]),
     ("error", f"concurrent requests must be between 1 and {LOADED_LIMITS['batch']}")),
    ("bench-negative-prompt-tokens", lambda s: bench(s.admin_page, prompt_tokens=-5),
     ("error", f"prompt tokens must be between 1 and {LOADED_LIMITS['prompt_tokens']}")),
    ("bench-zero-concurrent-requests", lambda s: bench(s.admin_page, batches=["0"]),
     ("error", f"concurrent requests must be between 1 and {LOADED_LIMITS['batch']}")),
    ("bench-non-integer-new-tokens", lambda s: bench(s.admin_page, new_tokens=12.5),
     ("error", "new tokens must be a whole number")),
    ("bench-non-integer-concurrent-requests", lambda s: bench(s.admin_page, batches=["1.5"]),
     ("error", "concurrent requests must be a whole number")),
    ("bench-prompt-tokens-a-string", lambda s: bench(s.admin_page, prompt_tokens="many"),
     ("error", "prompt tokens must be a whole number")),
    ("bench-new-tokens-null", lambda s: bench(s.admin_page, new_tokens=None),
     ("error", "new tokens must be a whole number")),
    ("bench-new-tokens-true", lambda s: bench(s.admin_page, new_tokens=True),
     ("error", "new tokens must be a whole number")),
    ("bench-concurrent-requests-not-a-list", lambda s: bench(s.admin_page, batches="8"),
     ("error", "concurrent requests must be a list")),
    ("bench-no-concurrent-requests", lambda s: bench(s.admin_page, batches=[]),
     ("error", "pick at least one number of concurrent requests")),
    ("bench-huge-by-route", lambda s: by_route(s.admin_page, "run", [8, 10**9, ["1"]]),
     ("error", f"new tokens must be between 1 and {LOADED_LIMITS['new_tokens']}")),
]

ADMIN_CASES = [
    ("load-max-memory-a-list", lambda s: named(s.admin, "/load_model", "demo", "fp32", "cpu",
                                               [1, 2]), ("AppError", "max_memory_gb")),
    ("load-model-a-number", lambda s: named(s.admin, "/load_model", 123),
     ("AppError", "model")),
    ("load-outside-the-folders", lambda s: named(s.admin, "/load_model", "/etc", "fp32",
                                                 "cpu"),
     ("AppError", "outside the allowed model folders")),
    ("load-unknown-mode", lambda s: named(s.admin, "/load_model", "demo", "q3"),
     ("AppError", "unknown mode")),
    ("load-context-a-string", lambda s: named(s.admin, "/load_model", "demo", "fp32", "cpu",
                                              None, None, "bf16", "big"),
     ("AppError", "context_tokens")),
    ("load-max-memory-negative", lambda s: named(s.admin, "/load_model", "demo", "fp32", "cpu",
                                                 {"cpu": -1}), ("AppError", "max_memory_gb")),
    # Refused before the running model is unloaded (checked: it is not even loaded again).
    ("load-pickle-only-folder", lambda s: named(s.admin, "/load_model",
                                                str(s.models / "pickle-only"), "fp32", "cpu"),
     ("AppError", "safetensors")),
    ("load-symlinked-safetensors", lambda s: named(s.admin, "/load_model",
                                                   str(s.models / "linked"), "fp32", "cpu"),
     ("AppError", "links outside the allowed model")),
    ("load-context-1e12", lambda s: named(s.admin, "/load_model", "demo", "fp32", "cpu", None,
                                          None, "bf16", 10**12), ("AppError", "context")),
    ("load-unknown-device", lambda s: named(s.admin, "/load_model", "demo", "fp32", "cpu",
                                            {"cuda:7": 1}), ("AppError", "cuda:7")),
    ("load-cpu-cap-too-small", lambda s: named(s.admin, "/load_model", "demo", "fp32", "cpu",
                                               {"cpu": 0.001}), ("AppError", "does not fit")),
    # An optimizer step of a million micro-batches could not be stopped: refused at the door.
    ("train-grad-accum-1e6", lambda s: train(s.admin, s.models / "deep.jsonl",
                                             grad_accum=10**6),
     ("AppError", "Grad accumulation (grad_accum) must be a whole number from 1 to 4,096")),
    ("train-tokens-per-step", lambda s: train(s.admin, s.models / "deep.jsonl",
                                              batch_size=1024, grad_accum=4096, max_len=256),
     ("AppError", "tokens per optimizer step; at most 16,777,216")),
    ("train-data-nested-deeply", lambda s: train(s.admin, s.models / "deep.jsonl"),
     ("AppError", "deep.jsonl:1: nested too deeply to read")),
    ("train-data-huge-number", lambda s: train(s.admin, s.models / "bigint.jsonl"),
     ("AppError", "bigint.jsonl:1: holds a number too long to read")),
]

OPEN = [
    ("open-foreign-host", lambda s: v1(s.v1, OK, headers={"Host": "rebound.example:7860"}),
     (400, "Host name")),
    ("open-foreign-host-on-gradio", lambda s: named_foreign_host(s), (400, "Host name")),
    ("open-text-plain", lambda s: text_plain(s), (415, "application/json")),
]


def named_foreign_host(side: Side) -> Outcome:
    response = side.v1.post("/gradio_api/call/unload_model", json={"data": []},
                            headers={"Host": "rebound.example"})
    return Outcome(response.status_code, response.json().get("detail", ""))


def text_plain(side: Side) -> Outcome:
    response = side.v1.post("/v1/chat/completions", content=json.dumps(OK),
                            headers={"Content-Type": "text/plain"})
    return Outcome(response.status_code, response.json()["error"]["message"])


CASES = [(*case, "guest") for case in V1 + NAMED + BENCH_GUEST] \
    + [(*case, "admin") for case in ADMIN_CASES + BENCH_ADMIN] + [(*case, "open") for case in OPEN]


@pytest.mark.parametrize(("attack", "expect", "who"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_a_bad_request_is_refused_plainly_and_hurts_no_one(request, attack, expect, who,
                                                           models_dir):
    side = request.getfixturevalue("open_side" if who == "open" else "side")
    before = side.model()
    log_before = len(side.log())
    victims = Victims(side.url, v1_headers=side.victim_headers, gradio=side.victim).start()
    outcome = attack(side)
    results = victims.finish()

    status, words = expect
    if status == "any":  # served or refused, but never a server error
        assert outcome.status == 200 or 400 <= outcome.status < 500, outcome
    else:
        assert outcome.status == status, outcome
    assert words in outcome.message, outcome
    paths = guest_paths(side, models_dir) if who == "guest" else ()
    assert not plain_problems(outcome.message, server_paths=paths), outcome
    if outcome.status == 401:
        assert outcome.headers.get("www-authenticate", "").startswith("Bearer")
    assert results == {"v1": "complete", "chat": "complete"}
    assert side.model() == before  # the same model, not even loaded again
    assert "unloaded" not in side.log()[log_before:]
    assert side.v1.get("/v1/models").status_code == 200


# -- a benchmark beside other users' replies ---------------------------------------------------------
# The admin's benchmark shares the engine with every chat: replies go first (it waits for a
# quiet engine and gives way between its steps), and neither side ends with an error. Replies
# streaming when it starts; replies arriving as it starts; replies arriving once its own
# batched runs are logged, that is while plain generate holds the decode worker (unless the
# benchmark has already ended: the assertions hold either way).
@pytest.mark.parametrize("first", ["replies", "benchmark", "plain-generate"],
                         ids=["bench-while-replies-stream", "bench-then-replies-arrive",
                              "bench-then-replies-during-plain-generate"])
def test_a_small_benchmark_beside_replies_completes_and_so_do_they(side, first):
    before = side.model()
    log_before = len(side.log())
    done: dict = {}

    def run_benchmark():
        done["outcome"] = bench(side.admin_page, 32, 64, ["1", "4"])

    benchmark = threading.Thread(target=run_benchmark, daemon=True)
    victims = Victims(side.url, v1_headers=side.victim_headers, gradio=side.victim)
    if first == "replies":
        victims.start()  # both replies have their first token
        benchmark.start()
    else:
        benchmark.start()
        deadline = time.monotonic() + 300
        while first == "plain-generate" and benchmark.is_alive() \
                and "bench_measure: batch 4:" not in side.log()[log_before:] \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        victims.start(wait_for_first_token=False)
    results = victims.finish()
    benchmark.join(600)

    assert results == {"v1": "complete", "chat": "complete"}
    outcome = done.get("outcome")
    assert outcome is not None, "the benchmark did not finish"
    assert outcome.status == 200, outcome
    assert "| fp32 | 1 |" in outcome.message and "| fp32 | 4 |" in outcome.message, outcome
    assert side.model() == before
    log = side.log()[log_before:]
    assert "unloaded" not in log and "Traceback" not in log
    assert side.v1.get("/v1/models").status_code == 200


# -- what a maximal history costs ------------------------------------------------------------------
# A conversation at every limit at once: 2000 messages (the most a history may have) holding
# together just under a million characters (the most a prompt may have). Before trimming was
# linear, 1999 messages of a few characters cost 25.7 s of CPU; now either shape is trimmed to
# the context window in well under this bound, on 2 busy cores, beside other users' replies.
MAX_HISTORY_SECONDS = 30.0


def history(messages: int, chars: int) -> list[dict]:
    text = ("sea " * (chars // 4 + 1))[:chars]
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": text}
            for i in range(messages - 1)] + [{"role": "user", "content": text}]


@pytest.mark.parametrize(("messages", "chars"), [(2000, 4), (2000, 495)],
                         ids=["2000-tiny-messages", "2000-messages-1M-chars"])
def test_a_maximal_history_costs_a_bounded_time(side, messages, chars):
    victims = Victims(side.url, v1_headers=side.victim_headers, gradio=side.victim).start()
    start = time.monotonic()
    outcome = v1(side.v1, {"messages": history(messages, chars), "max_tokens": 8,
                           "temperature": 0})
    seconds = time.monotonic() - start
    results = victims.finish()
    assert outcome.status == 200, outcome  # trimmed to fit, with a notice
    assert seconds < MAX_HISTORY_SECONDS, f"{seconds:.1f} s"
    assert results == {"v1": "complete", "chat": "complete"}


def test_the_api_schema_needs_a_login(side):
    with httpx.Client(base_url=side.url, timeout=60) as anonymous:
        refused = anonymous.get("/openapi.json")
        assert refused.status_code == 401
        assert refused.headers["www-authenticate"].startswith("Bearer")
        assert "paths" not in refused.text
    assert "/v1/chat/completions" in side.v1.get("/openapi.json").json()["paths"]  # bearer
    assert side.page.get("/openapi.json").status_code == 200  # the page's login cookie


def test_guests_see_the_model_folder_relative_to_the_models_folder(side, models_dir):
    folder = models_dir / "demo-copy"
    try:
        loaded = side.admin.predict(str(folder), "fp32", "cpu", api_name="/load_model")
        assert loaded["model_path"] == str(folder)  # the admin sees where it is
        assert side.guest.predict(api_name="/status")["model_path"] == "demo-copy"
        assert [m["id"] for m in side.v1.get("/v1/models").json()["data"]] == ["demo-copy"]
        refusal = named(side.guest, "/load_model", str(folder), "fp32", "cpu")
        assert str(models_dir) not in refusal.message
        estimate = page_handler(side.page, "estimate", {1: str(folder / "missing")})
        assert "missing" in estimate.message and str(models_dir) not in estimate.message
    finally:
        side.admin.predict("demo", "fp32", "cpu", api_name="/load_model")
