"""Tools of the hardening catalogue (test_hardening.py): ways to send a bad request to the real
app (OpenAI API, gradio's named endpoints, raw HTTP, the page's handlers by fn_index), the
innocent replies streaming beside each one, and the check that a refusal is plain."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import uuid
from dataclasses import dataclass, field

import httpx
from gradio_client import Client
from gradio_client.exceptions import AppError

PROMPT = [{"role": "user", "content": "Tell me about the sea."}]
VICTIM_TOKENS = 32


@dataclass
class Outcome:
    status: int | str  # an HTTP status, or "AppError" (gradio_client), or "error" (queue)
    message: str
    headers: dict = field(default_factory=dict)


# -- sending ------------------------------------------------------------------------------------
def v1(http: httpx.Client, body=None, *, raw: bytes | None = None, headers=None) -> Outcome:
    content = raw if raw is not None else json.dumps(body).encode()
    response = http.post("/v1/chat/completions", content=content,
                         headers={"Content-Type": "application/json", **(headers or {})})
    if response.status_code == 200:
        return Outcome(200, response.text[:300])
    return Outcome(response.status_code, response.json()["error"]["message"],
                   dict(response.headers))


def named(client: Client, api_name: str, *args) -> Outcome:
    try:
        result = client.predict(*args, api_name=api_name)
    except AppError as error:
        return Outcome("AppError", str(error))
    return Outcome(200, json.dumps(result)[:2000])


def raw_post(http: httpx.Client, path: str, content: bytes) -> Outcome:
    response = http.post(path, content=content, headers={"Content-Type": "application/json"})
    try:
        message = response.json().get("detail", response.text)
    except ValueError:
        message = response.text
    return Outcome(response.status_code, str(message))


def page_handler(http: httpx.Client, api_name: str, values: dict[int, object]) -> Outcome:
    """Call one of the page's own (private) handlers the way the browser does: by fn_index
    through gradio's queue, with the page's default values except `values` (by position)."""
    config = http.get("/config").json()
    components = {c["id"]: c for c in config["components"]}
    dep = next(d for d in config["dependencies"] if d.get("api_name") == api_name)
    data = [components[i]["props"].get("value") for i in dep["inputs"]]
    for position, value in values.items():
        data[position] = value
    session = uuid.uuid4().hex[:12]
    joined = http.post("/gradio_api/queue/join", json={
        "data": data, "fn_index": dep["id"], "session_hash": session, "event_data": None,
        "trigger_id": dep["targets"][0][0] if dep["targets"] else None})
    if joined.status_code != 200:
        return Outcome(joined.status_code, joined.text)
    with http.stream("GET", "/gradio_api/queue/data", params={"session_hash": session}) as s:
        for line in s.iter_lines():
            if not line.startswith("data:"):
                continue
            message = json.loads(line[5:])
            if message.get("msg") == "process_completed":
                output = message.get("output") or {}
                if not message.get("success"):
                    return Outcome("error", str(output.get("error")))
                return Outcome(200, json.dumps(output.get("data"))[:2000])
    return Outcome("error", "the queue closed without a result")


def by_route(http: httpx.Client, api_name: str, data: list) -> Outcome:
    """Call a handler by name through gradio's REST route (/gradio_api/call/NAME), which
    answers the page's private handlers too."""
    posted = http.post(f"/gradio_api/call/{api_name}", json={"data": data})
    if posted.status_code != 200:
        return Outcome(posted.status_code, posted.text)
    event = None
    with http.stream("GET", f"/gradio_api/call/{api_name}/{posted.json()['event_id']}") as s:
        for line in s.iter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:") and event == "error":
                return Outcome("error", str((json.loads(line[5:]) or {}).get("error")))
            elif line.startswith("data:") and event == "complete":
                return Outcome(200, line[5:].strip()[:2000])
    return Outcome("error", "the stream closed without a result")


@contextlib.contextmanager
def chat_stream(http: httpx.Client, message: str, settings: dict | None = None):
    """gradio's named /chat opened as gradio_client opens it (join the queue, then read the
    session's event stream), the stream held open and unread inside the block and closed on
    leaving it: a client that goes away mid-reply."""
    config = http.get("/config").json()
    dep = next(d for d in config["dependencies"] if d.get("api_name") == "chat")
    session = uuid.uuid4().hex[:12]
    joined = http.post("/gradio_api/queue/join", json={
        "data": [message, [], settings or {}, "", False], "fn_index": dep["id"],
        "session_hash": session, "event_data": None, "trigger_id": None})
    assert joined.status_code == 200, joined.text
    with http.stream("GET", "/gradio_api/queue/data", params={"session_hash": session}) as s:
        yield s


def page_login(url: str, user: str, password: str) -> httpx.Client:
    """An HTTP client holding the page's login cookie."""
    http = httpx.Client(base_url=url, timeout=300)
    response = http.post("/login", data={"username": user, "password": password})
    assert response.status_code in (200, 302, 303), response.text
    return http


# -- checking -----------------------------------------------------------------------------------
_EXCEPTION = re.compile(r"\b[A-Z][A-Za-z]*(Error|Exception)\b|Traceback|File \"")


def plain_problems(message: str, *, server_paths: tuple[str, ...] = ()) -> list[str]:
    """What makes a refusal not plain: an exception's name or trace, HTML entities, a server
    path (for guests)."""
    problems = []
    if _EXCEPTION.search(message):
        problems.append("names an exception")
    if re.search(r"&(lt|gt|amp|quot|#\d+);", message):
        problems.append("HTML entities")
    for path in server_paths:
        if path and path in message:
            problems.append(f"shows the server path {path}")
    if not message.strip() or message.strip() in ("None", "null"):
        problems.append("no message")
    return problems


# -- the innocent ---------------------------------------------------------------------------------
class Victims:
    """Replies of other users streaming while an attack runs: one through /v1, one through
    gradio's /chat. Each must end normally (a finish reason, no error)."""

    def __init__(self, url: str, *, v1_headers: dict, gradio: Client):
        self.url, self.v1_headers, self.gradio = url, v1_headers, gradio
        self.results: dict[str, str] = {}
        self.started = threading.Barrier(3)  # both victims have their first token, and us
        self.threads = [threading.Thread(target=self._v1, daemon=True),
                        threading.Thread(target=self._chat, daemon=True)]

    def start(self, *, wait_for_first_token: bool = True) -> Victims:
        self.waits = wait_for_first_token
        for thread in self.threads:
            thread.start()
        if wait_for_first_token:
            self.started.wait(timeout=300)
        return self

    def _arrived(self) -> None:
        if self.waits:
            try:
                self.started.wait(timeout=300)
            except threading.BrokenBarrierError:
                pass

    def _v1(self) -> None:
        body = {"messages": PROMPT, "temperature": 0, "max_tokens": VICTIM_TOKENS,
                "stream": True, "enable_thinking": False}
        finish, first, done = None, True, False
        try:
            with httpx.stream("POST", self.url + "/v1/chat/completions", json=body,
                              headers=self.v1_headers, timeout=300) as response:
                if response.status_code != 200:
                    self.results["v1"] = f"status {response.status_code}: {response.read()!r}"
                    self._arrived()
                    return
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        self.results["v1"] = f"error event: {event['error']['message']}"
                        return
                    choice = event["choices"][0] if event["choices"] else {}
                    if first and choice.get("delta", {}).get("content"):
                        first = False
                        self._arrived()
                    finish = choice.get("finish_reason") or finish
            self.results["v1"] = "complete" if done and finish in ("length", "stop") \
                else f"ended without a finish ({finish}, done={done})"
        except Exception as error:  # noqa: BLE001 - reported as the victim's result
            self.results["v1"] = f"failed: {error!r}"
        finally:
            if first:
                self._arrived()

    def _chat(self) -> None:
        first = True
        try:
            final = None
            job = self.gradio.submit("Tell me about the sea.", [],
                                     {"temperature": 0, "max_new_tokens": VICTIM_TOKENS},
                                     "", False, api_name="/chat")
            for final in job:
                if first:
                    first = False
                    self._arrived()
            ok = final is not None and final["done"] and final["stats"]["new_tokens"] > 0
            self.results["chat"] = "complete" if ok else f"incomplete: {final!r}"
        except Exception as error:  # noqa: BLE001 - reported as the victim's result
            self.results["chat"] = f"failed: {error!r}"
        finally:
            if first:
                self._arrived()

    def finish(self, timeout: float = 300) -> dict[str, str]:
        for thread in self.threads:
            thread.join(timeout)
        return self.results


# -- training -----------------------------------------------------------------------------------
TRAIN_FIELDS = ["model", "upload", "data_path", "name", "method", "epochs", "steps", "lr",
                "batch_size", "grad_accum", "max_len", "lora_r", "packing"]


def train(client: Client, data, **changes) -> Outcome:
    """/train_start with sane values except `changes` (by field name)."""
    values = {"model": "demo", "upload": None, "data_path": str(data), "name": "attack-run",
              "method": "lora", "epochs": 1, "steps": 1, "lr": None, "batch_size": 1,
              "grad_accum": 1, "max_len": 64, "lora_r": 4, "packing": False, **changes}
    return named(client, "/train_start", *(values[f] for f in TRAIN_FIELDS))


def page_load_outputs(http: httpx.Client) -> dict[str, str]:
    """What each of the page's load events gives this login (by the event's api name, as
    JSON): every handler that runs when the page opens, called the way the browser does."""
    config = http.get("/config").json()
    components = {c["id"]: c for c in config["components"]}
    outputs = {}
    for dep in config["dependencies"]:
        if not any(target[1] == "load" for target in dep["targets"]):
            continue
        data = [components[i]["props"].get("value") for i in dep["inputs"]]
        outputs[dep.get("api_name") or str(dep["id"])] = run_by_index(http, dep["id"], data)
    return outputs


def run_by_index(http: httpx.Client, fn_index: int, data: list) -> str:
    session = uuid.uuid4().hex[:12]
    joined = http.post("/gradio_api/queue/join", json={
        "data": data, "fn_index": fn_index, "session_hash": session, "event_data": None,
        "trigger_id": None})
    assert joined.status_code == 200, joined.text
    with http.stream("GET", "/gradio_api/queue/data", params={"session_hash": session}) as s:
        for line in s.iter_lines():
            if line.startswith("data:"):
                message = json.loads(line[5:])
                if message.get("msg") == "process_completed":
                    return json.dumps(message.get("output"))
    return ""
