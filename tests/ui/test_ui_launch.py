"""app.py's start: flags are answered without importing torch, and every route is there from
the first request the server answers."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from .conftest import ROOT, RunningApp


def imported_modules(*args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run app.py under -X importtime: its result and the names of every module it imported."""
    result = subprocess.run([sys.executable, "-X", "importtime", "app.py", *args], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, check=False)
    modules = {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines()
               if line.startswith("import time:") and "|" in line}
    return result, modules


@pytest.mark.parametrize(("args", "status"), [
    (["--help"], 0),
    (["--share"], 2),  # refused: no login
    (["--auth", "nocolon"], 2),
    (["--compile-mode", "fastest"], 2),
])
def test_flags_are_answered_without_importing_torch(args, status):
    result, modules = imported_modules(*args)
    assert result.returncode == status, result.stderr[-2000:]
    assert "argparse" in modules  # the import list was read
    heavy = sorted(m for m in modules if m.split(".")[0] in ("torch", "transformers", "gradio"))
    assert not heavy, heavy[:10]


def test_the_openai_routes_answer_from_the_first_request(tmp_path):
    """A client that calls as soon as the port opens gets the endpoint's own answer (here 401,
    a login is needed), never a 404 from a server whose routes are still being added."""
    # No model to load (the routes do not depend on one): the start is quicker.
    app = RunningApp(["--model", "/nonexistent/model", "--auth", "ann:secret"], tmp_path)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert app.proc.poll() is None, app.output()
            assert time.monotonic() < deadline, f"the app did not answer:\n{app.output()}"
            try:
                first = httpx.get(app.url + "/v1/models", timeout=30)
                break
            except httpx.TransportError:  # the port is not open yet
                time.sleep(0.01)
        assert first.status_code == 401, first.text
        assert first.json()["error"]["type"] == "authentication_error"
    finally:
        app.stop()
