"""The engine surface both engines share, the --backend flags, and the bench command through a
(fake) model server."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest

from model_utils.backends import ChatBackend
from model_utils.backends.bench import bench_remote
from model_utils.backends.bench import main as bench_main
from model_utils.backends.openai_client import ServerConfig
from model_utils.backends.remote import RemoteEngine
from model_utils.backends.urls import normalize_url, redact
from model_utils.engine import Engine

from .conftest import ROOT
from .fake_model_server import FakeModelServer

MEMBERS = [name for name, value in vars(ChatBackend).items()
           if callable(value) and not name.startswith("_")]


@pytest.fixture(scope="module")
def server():
    fake = FakeModelServer().start()
    yield fake
    fake.stop()


@pytest.fixture(scope="module")
def engines(server):
    local = Engine()
    remote = RemoteEngine(ServerConfig(server.url), start_health=False)
    yield local, remote
    remote.close()


def test_both_engines_have_the_surface_the_ui_uses(engines):
    assert {"status", "chat", "queue_status", "memory_snapshot", "supports_thinking",
            "default_settings", "load", "unload", "estimate"} <= set(MEMBERS)
    for engine in engines:
        assert isinstance(engine, ChatBackend)
        for name in MEMBERS:
            wanted = list(inspect.signature(getattr(ChatBackend, name)).parameters)[1:]
            given = list(inspect.signature(getattr(engine, name)).parameters)
            assert given == wanted, f"{type(engine).__name__}.{name}{given} != {wanted}"
        assert engine.max_batch >= 1 and engine.max_queue >= 0


def test_urls_are_checked_and_shown_without_credentials():
    assert normalize_url("http://gpu-node:8000") == "http://gpu-node:8000/v1"
    assert normalize_url("https://h/openai/v1/") == "https://h/openai/v1"
    assert redact("http://me:s3cret@gpu:8000/v1?key=s3cret") == "http://gpu:8000/v1"
    for bad in ("gpu-node:8000", "ftp://h/v1", "http:///v1"):
        with pytest.raises(ValueError, match="expected an http"):
            normalize_url(bad)


@pytest.mark.parametrize(("flags", "words"), [
    (["--backend", "ftp://h"], "expected an http(s) URL"),
    (["--backend-key", "k"], "need --backend"),
    (["--backend", "http://h/v1", "--backend-key", "k", "--backend-key-file", "f"], "not both"),
    (["--backend", "http://h/v1", "--backend-connect-timeout", "0"], "> 0"),
])
def test_bad_backend_flags_are_refused_at_once(flags, words):
    done = subprocess.run([sys.executable, "app.py", *flags], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 2 and words in done.stderr


def test_the_header_says_when_the_server_is_down(server):
    from server.model_actions import headline

    from .conftest import free_port

    down = RemoteEngine(ServerConfig(f"http://127.0.0.1:{free_port()}/v1",
                                     connect_timeout_s=1.0))
    up = RemoteEngine(ServerConfig(server.url))
    other = RemoteEngine(ServerConfig(server.url), model="Qwen/Qwen3-14B")
    try:
        assert headline(other.status()).endswith(f"{server.url} does not serve Qwen/Qwen3-14B")
        assert "it serves fake/Qwen3-0B" in other.status()["health"]["error"]
        assert headline(down.status()) == (f"**Serving:** nothing now: the model server "
                                           f"{down.url} is down")
        assert headline(up.status()) == f"**Serving:** fake/Qwen3-0B · remote · {server.url}"
    finally:
        for engine in (down, up, other):
            engine.close()


def test_bench_measures_through_the_server(engines, server):
    rows = bench_remote(engines[1], streams=(1, 3), new_tokens=8)
    assert [r.streams for r in rows] == [1, 3]
    assert all(r.errors == 0 and r.replies == r.streams and r.ttft_ms_p50 > 0 for r in rows)
    assert all(r.new_tokens == 3 * r.streams for r in rows)  # the fake's usage: 3 tokens


def test_bench_command_writes_json(server, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench_main(["--backend", server.url, "--streams", "1,2", "--new-tokens", "8",
                       "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["model"] and [r["streams"] for r in data["rows"]] == [1, 2]
    assert "| streams |" in capsys.readouterr().out


def test_bench_command_says_when_the_server_is_down(tmp_path, capsys):
    from .conftest import free_port

    code = bench_main(["--backend", f"http://127.0.0.1:{free_port()}/v1", "--streams", "1",
                       "--backend-connect-timeout", "1"])
    assert code == 1
    assert "not reachable" in capsys.readouterr().out


def test_the_front_end_for_a_model_server_starts_without_torch(server):
    """The whole --backend page (every tab, the gradio and OpenAI endpoints, app.py's flags)
    is built in a process that never imports torch or transformers: it loads no model."""
    script = (
        "import sys\n"
        "import app, ui\n"
        "from fastapi import APIRouter\n"
        "from model_utils.backends.flags import remote_engine\n"
        f"args = app.parse_args(['--backend', {server.url!r}])\n"
        "engine = remote_engine(args)\n"
        "demo = ui.build(engine)\n"
        "ui.register_openai_api(APIRouter(), engine, [])\n"
        "engine.close()\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'transformers', 'accelerate', 'peft', 'bitsandbytes'))\n"
        "print('heavy:', heavy[:5])\n"
        "sys.exit(1 if heavy else 0)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=180, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
