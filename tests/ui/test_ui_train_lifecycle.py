"""A training run never outlives its server: a graceful shutdown ends it after a checkpoint,
a server killed outright leaves a run that stops itself, and a run still training into the
models folder when a server starts (left by an earlier one, or started by hand) is found
and ended, and the Train tab says so, instead of saying idle beside it."""

from __future__ import annotations

import json
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gradio_client import Client

from model_utils.finetune import run_lock
from model_utils.loading.demo_model import demo_model_path
from model_utils.training import checkpoint as ckpt

from .conftest import ROOT


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    demo_model_path()
    folder = tmp_path_factory.mktemp("models")
    (folder / "qa.jsonl").write_text(json.dumps({"messages": [
        {"role": "user", "content": "Where is the key?"},
        {"role": "assistant", "content": "Under the stone."}]}) + "\n")
    return folder


def long_run(models_dir, name: str, steps: int = 100_000) -> list:
    # model, upload, data path, name, method, epochs, steps, lr, batch, accum, max len, rank,
    # packing
    return ["demo", None, str(models_dir / "qa.jsonl"), name, "lora", 3, steps, 1e-3, 1, 1,
            64, 4, False]


def wait_for(condition, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while not (value := condition()):
        assert time.monotonic() < deadline, what
        time.sleep(0.2)
    return value


def training(models_dir, name: str) -> run_lock.RunLock:
    """The run's own claim on its folder, once it has logged a step."""
    wait_for(lambda: ckpt.read_train_log(models_dir / name), 120, "no step logged")
    lock = run_lock.read(models_dir / name)
    assert lock is not None and lock.alive()
    return lock


def test_a_graceful_shutdown_ends_the_run_after_a_checkpoint(start_app, models_dir):
    app = start_app("--models-dir", str(models_dir), "--placement", "cpu",
                    "--shutdown-grace", "10")
    Client(app.url, verbose=False).predict(*long_run(models_dir, "at-shutdown"),
                                           api_name="/train_start")
    lock = training(models_dir, "at-shutdown")
    uploads = check_uploads(app.url)
    app.proc.send_signal(signal.SIGTERM)
    assert app.proc.wait(timeout=60) == 0
    assert not lock.alive(), "the run outlived its server"
    assert ckpt.has_checkpoint(models_dir / "at-shutdown")
    assert "at-shutdown stopped for the shutdown" in app.log()
    assert not uploads.exists(), "the uploads outlived the server"


def upload(url: str, data: bytes) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    boundary = "qwenchatboundary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"files\"; "
            f"filename=\"data.jsonl\"\r\nContent-Type: application/octet-stream\r\n\r\n"
            ).encode() + data + f"\r\n--{boundary}--\r\n".encode()
    request = urllib.request.Request(url + "/gradio_api/upload", data=body, headers={
        "Content-Type": f"multipart/form-data; boundary={boundary}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def check_uploads(url: str) -> Path:
    """An upload lands in a folder of the server's own, private to its user; one over the
    cap is refused with a message. Returns that folder."""
    from server.uploads import MAX_UPLOAD_MB

    status, body = upload(url, b'{"messages": []}\n')
    assert status == 200, body
    stored = Path(json.loads(body)[0])
    folder = next(p for p in stored.parents if p.name.startswith("qwen-chat-uploads-"))
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    status, body = upload(url, b"x" * (MAX_UPLOAD_MB * 2**20 + 1))
    assert status == 413 and "maximum allowed size" in body, (status, body[:300])
    return folder


def test_a_run_stops_itself_when_its_server_is_killed(start_app, models_dir):
    app = start_app("--models-dir", str(models_dir), "--placement", "cpu")
    Client(app.url, verbose=False).predict(*long_run(models_dir, "orphaned"),
                                           api_name="/train_start")
    lock = training(models_dir, "orphaned")
    app.proc.kill()  # no shutdown at all: the run is re-parented
    app.proc.wait()
    wait_for(lambda: not lock.alive(), 20, "the orphaned run went on training")
    assert ckpt.has_checkpoint(models_dir / "orphaned")


def test_a_leftover_run_is_ended_at_start_up_and_shown(start_app, models_dir):
    by_hand = subprocess.Popen(
        [sys.executable, "-m", "model_utils.finetune", "--model", "demo", "--data",
         str(models_dir / "qa.jsonl"), "--out", str(models_dir / "leftover"), "--steps",
         "100000", "--batch-size", "1", "--max-len", "64", "--lora-r", "4", "--no-progress"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        training(models_dir, "leftover")
        app = start_app("--models-dir", str(models_dir), "--placement", "cpu")
        assert by_hand.wait(timeout=5) == 130  # interrupted, after saving a checkpoint
    finally:
        if by_hand.poll() is None:
            by_hand.kill()
    assert ckpt.has_checkpoint(models_dir / "leftover")
    client = Client(app.url, verbose=False)
    status = client.predict(api_name="/train_status")
    assert status["state"] == "idle"
    assert ("A run left by an earlier server, **leftover**, was stopped at start-up (Start "
            "with the same name resumes it from its checkpoint)") in status["message"], status
    # Nothing trains beside it any more: a new run starts and finishes.
    client.predict(*long_run(models_dir, "after-leftover", steps=2), api_name="/train_start")
    wait_for(lambda: client.predict(api_name="/train_status")["state"] == "finished", 120,
             "the run after the leftover did not finish")
