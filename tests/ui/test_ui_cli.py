"""app.py's command line: help, refusing to expose the app without a login, and starting
even when the start-up model cannot be loaded."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request

import pytest
from gradio_client import Client

from .conftest import ROOT

FLAGS = ["--model", "--mode", "--placement", "--host", "--port", "--share", "--auth",
         "--auth-file", "--admin", "--models-dir", "--log-file", "--log-prompts",
         "--trust-remote-code", "--max-queue", "--max-batch", "--compile-mode"]


def run_app(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "app.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_help_explains_every_flag():
    result = run_app("--help")
    assert result.returncode == 0
    for flag in FLAGS:
        assert flag in result.stdout, flag


@pytest.mark.parametrize("args", [
    ["--share"],
    ["--host", "0.0.0.0"],
    ["--host", "192.168.1.10", "--share"],
])
def test_exposed_without_login_exits_2_naming_auth(args, tmp_path):
    log_file = tmp_path / "server.log"
    result = run_app(*args, "--log-file", str(log_file))
    assert result.returncode == 2
    assert "--auth" in result.stderr
    assert not log_file.exists(), "nothing is started (or logged) before the check"


@pytest.mark.parametrize(("args", "expected"), [
    (["--admin", "a"], "--admin needs logins"),
    (["--auth", "a:b", "--admin", "z"], "no such user"),
    (["--auth", "nocolon"], "user:password"),
    (["--auth-file", "/nonexistent/logins"], "cannot read"),
])
def test_bad_login_flags_exit_2(args, expected):
    result = run_app(*args)
    assert result.returncode == 2
    assert expected in result.stderr


def test_compile_mode_offers_the_engine_modes_and_refuses_others():
    sys.path.insert(0, str(ROOT))
    import app
    from model_utils.engine_config import COMPILE_MODES

    for mode in COMPILE_MODES:
        assert app.parse_args(["--compile-mode", mode]).compile_mode == mode
    result = run_app("--compile-mode", "fastest")
    assert result.returncode == 2
    assert "--compile-mode" in result.stderr


def test_starts_without_a_model_when_the_startup_load_fails(start_app):
    app = start_app("--model", "/nonexistent/model")
    client = Client(app.url, verbose=False)
    assert client.predict(api_name="/status")["loaded"] is False
    # The reason is on the page (the model panel's message) and in the log.
    with urllib.request.urlopen(app.url + "/config") as response:
        config = json.dumps(json.load(response))
    assert "start-up model did not load" in config and "/nonexistent/model" in config
    assert "initial model did not load" in app.log()
    # And the app still works: load the demo model and chat.
    assert client.predict("demo", "bf16", "cpu", api_name="/load_model")["loaded"]
    reply = client.predict("Hi", [], {"max_new_tokens": 4, "temperature": 0}, api_name="/chat")
    assert reply["done"]


def test_the_console_shows_only_this_apps_lines(start_app):
    """No gradio start lines (their share=True advice contradicts --share + --auth), no library
    progress bars or notices: each line is one of this app's log records."""
    app = start_app("--mode", "nf4", "--placement", "cpu")
    Client(app.url, verbose=False).predict(
        "Hi", [], {"max_new_tokens": 4, "temperature": 0}, api_name="/chat")
    console = app.output()
    assert "serving on http://127.0.0.1" in console
    assert "share=True" not in console and "Running on local URL" not in console
    assert "kernels" not in console and "Loading weights" not in console
    lines = [line for line in console.splitlines() if line.strip()]
    strays = [line for line in lines if not re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ", line)]
    assert not strays, strays
