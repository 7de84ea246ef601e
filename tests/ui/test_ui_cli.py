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

from .conftest import ROOT, free_port

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


@pytest.mark.parametrize(("args", "expected"), [
    (["--port", "99999"], "--port: must be a port number from 1 to 65535, got 99999"),
    (["--port", "0"], "--port: must be a port number from 1 to 65535"),
    (["--port", "http"], "--port: must be a port number, got 'http'"),
    # A typo in the mode or the placement: refused with the names to pick from, rather than
    # an app that starts serving no model.
    (["--mode", "bogus"], "unknown mode 'bogus'; choose one of: fp32, bf16"),
    (["--placement", "gpu"], "unknown placement 'gpu'; choose cpu, cuda:N"),
    (["--placement", "cuda:first"], "unknown placement 'cuda:first'"),
])
def test_bad_port_mode_or_placement_exits_2_with_a_plain_message(args, expected, tmp_path):
    log_file = tmp_path / "server.log"
    # A free port first (a --port of the case comes later and wins): an app that is not
    # refused serves there, not on the default port.
    result = run_app("--port", str(free_port()), *args, "--log-file", str(log_file))
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    assert not log_file.exists(), "refused before anything is started"


def test_every_mode_and_placement_name_is_taken():
    sys.path.insert(0, str(ROOT))
    import app
    from model_utils.loading.modes import MODES
    from model_utils.loading.placement import STRATEGIES

    for mode in MODES:
        assert app.parse_args(["--mode", mode]).mode == mode
    # cuda:N by its name: whether this machine has that GPU is the load's to say.
    for placement in ["cpu", "cuda:0", "cuda:11", *STRATEGIES]:
        assert app.parse_args(["--placement", placement]).placement == placement
    assert app.parse_args(["--port", "65535"]).port == 65535


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
