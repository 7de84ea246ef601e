"""tools/load_test.py against the real app (python app.py, demo model, CPU) on a free port."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from .helpers import REPO_ROOT

SCRIPT = REPO_ROOT / "tools" / "load_test.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_url(tmp_path_factory):
    folder = tmp_path_factory.mktemp("load-test-app")
    port = free_port()
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONUNBUFFERED": "1"}
    with (folder / "console.txt").open("w") as console:
        proc = subprocess.Popen(
            [sys.executable, "app.py", "--port", str(port), "--log-file",
             str(folder / "server.log"), "--model", "demo", "--mode", "fp32",
             "--placement", "cpu"], cwd=REPO_ROOT, stdout=console, stderr=subprocess.STDOUT,
            env=env)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail(f"app exited: {(folder / 'console.txt').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(url + "/gradio_api/info", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    proc.kill()
                    pytest.fail("app did not start in 300 s")
                time.sleep(0.3)
        yield url
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def load_test(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)


def test_a_small_bounded_load_has_no_errors_lost_or_truncated_replies(app_url, tmp_path):
    out = tmp_path / "load.json"
    result = load_test("--url", app_url, "--clients", "4", "--requests", "2",
                       "--max-new-tokens", "16", "--prompt-words", "35", "--timeout", "240",
                       "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())["report"]
    assert report["replies"] == 8
    assert (report["errors"], report["lost"], report["truncated"]) == (0, 0, 0)
    assert report["new_tokens"] > 0 and report["aggregate_tok_s"] > 0
    assert 0 < report["ttft_p50_s"] <= report["ttft_p99_s"]
    # 35 words are about 92 tokens of the demo tokenizer, with the chat template around them
    assert 75 <= report["prompt_tokens_p50"] <= 115
    assert 0 < report["reply_tok_s_min"] <= report["reply_tok_s_p50"]
    assert 0 <= report["serving_overhead_p50_s"] <= report["serving_overhead_p99_s"]
    assert report["updates_per_reply_p50"] >= 1
    assert "errors 0, lost 0, truncated 0" in result.stdout


@pytest.mark.parametrize("url", ["http://10.0.0.1:7860", "http://example.com",
                                 "http://192.168.1.5:7860/", "ftp://127.0.0.1/"])
def test_it_refuses_any_host_but_loopback(url):
    result = load_test("--url", url)
    assert result.returncode == 2
    assert "refusing" in result.stderr or "not an http(s) URL" in result.stderr


@pytest.mark.parametrize("flag, value", [("--clients", "65"), ("--requests", "0"),
                                         ("--max-new-tokens", "5000"), ("--timeout", "0")])
def test_it_stays_bounded(flag, value):
    result = load_test(flag, value)
    assert result.returncode == 2 and "must be between" in result.stderr


def test_clients_that_cannot_connect_are_errors_and_the_run_ends():
    result = load_test("--url", "http://127.0.0.1:9", "--clients", "3", "--requests", "2",
                       "--timeout", "60")
    assert result.returncode == 1
    assert "replies 0, errors 6" in result.stdout
    assert "connect:" in result.stdout


def test_the_same_load_through_the_openai_endpoint(app_url, tmp_path):
    out = tmp_path / "load.json"
    result = load_test("--url", app_url, "--api", "openai", "--clients", "3", "--requests", "2",
                       "--max-new-tokens", "16", "--prompt-words", "35", "--timeout", "240",
                       "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())["report"]
    assert (report["replies"], report["errors"], report["lost"], report["truncated"]) == \
        (6, 0, 0, 0)
    # Each reply ends at max_new_tokens or where the demo model ends its answer.
    assert 6 < report["new_tokens"] <= 6 * 16
    assert 75 <= report["prompt_tokens_p50"] <= 115
    assert 0 < report["ttft_p50_s"] <= report["ttft_p99_s"]
