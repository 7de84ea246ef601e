"""Run the real app (python app.py ...) as a subprocess and wait until it serves.

Starting the app costs ~10 s on two idle cores (imports + the demo model), several times that
on a loaded machine, so each test module shares one instance through a module-scoped fixture
and the wait for it is generous.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_taken(output: str) -> bool:
    """Whether an app's output says that its port was taken (gradio, or the socket itself)."""
    text = output.lower()
    return "cannot find empty port" in text or "address already in use" in text


class RunningApp:
    def __init__(self, args: list[str], workdir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_file = workdir / "server.log"
        self.console = workdir / "console.txt"
        env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONUNBUFFERED": "1"}
        self._console = self.console.open("w")
        self.proc = subprocess.Popen(
            # Each app its own chat store (a test's --chat-store comes later and wins):
            # chats of one test's logins never reach another's, nor the user's own file.
            [sys.executable, "app.py", "--port", str(self.port), "--log-file",
             str(self.log_file), "--chat-store", str(workdir / "chats.sqlite3"), *args],
            cwd=ROOT, stdout=self._console, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 300) -> RunningApp:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"app exited with {self.proc.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(self.url + "/gradio_api/info", timeout=2):
                    return self
            except OSError as error:
                # 401/403 (auth on) still means the server is up.
                if getattr(error, "code", None) in (401, 403):
                    return self
                time.sleep(0.3)
        raise RuntimeError(f"app did not start in {timeout} s:\n{self.output()}")

    def output(self) -> str:
        self._console.flush()
        return self.console.read_text(errors="replace")

    def log(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._console.close()


@pytest.fixture(scope="module")
def start_app(tmp_path_factory):
    """start_app(*flags) -> a RunningApp, stopped when the module's tests are done."""
    apps: list[RunningApp] = []

    def start(*args: str) -> RunningApp:
        for attempt in range(3):
            app = RunningApp(list(args), tmp_path_factory.mktemp("app"))
            apps.append(app)
            try:
                return app.wait_ready()
            except RuntimeError as error:
                # free_port's port is free when picked, not reserved: another process may
                # take it before the app binds it. Then the app starts again on another.
                if attempt == 2 or not port_taken(str(error)):
                    raise
                app.stop()

    yield start
    for app in apps:
        app.stop()


@pytest.fixture(scope="module")
def start_random_demo(start_app, tmp_path_factory):
    """start_random_demo(*flags): the app serving the demo model's shape, tokenizer and name
    with random weights. Stop, shutdown and streaming checks need replies that go on for
    thousands of tokens, and the trained demo model ends its answers within a fraction of a
    second."""
    from transformers import AutoTokenizer

    from model_utils.loading.demo_model import _build_model, demo_model_path

    trained = demo_model_path()
    cache = tmp_path_factory.mktemp("random-demo")
    tokenizer = AutoTokenizer.from_pretrained(trained)
    tokenizer.save_pretrained(cache / trained.name)
    _build_model(tokenizer).save_pretrained(cache / trained.name)

    def start(*args: str) -> RunningApp:
        previous = os.environ.get("QWEN_CHAT_CACHE")
        os.environ["QWEN_CHAT_CACHE"] = str(cache)  # read by the app process it starts
        try:
            return start_app(*args)
        finally:
            if previous is None:
                os.environ.pop("QWEN_CHAT_CACHE")
            else:
                os.environ["QWEN_CHAT_CACHE"] = previous

    return start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test against a running app shows the end of the app's log, and one with a
    browser page leaves a screenshot in test-artifacts/: a failure seen once under load can
    be read afterwards."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    funcargs = getattr(item, "funcargs", {})
    for value in funcargs.values():
        if isinstance(value, RunningApp):
            report.sections.append(("the app's log, last 40 lines",
                                    "\n".join(value.log().splitlines()[-40:])))
    page = funcargs.get("page")
    if page is not None and hasattr(page, "screenshot"):
        ARTIFACTS.mkdir(exist_ok=True)
        try:
            page.screenshot(path=str(ARTIFACTS / f"{item.name[:100]}.png"), full_page=True)
        except Exception as error:  # a closed or hung page: the report has the rest
            report.sections.append(("screenshot", f"not taken: {error}"))


@pytest.fixture(scope="session")
def artifacts() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS
