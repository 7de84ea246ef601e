"""--tp 2 on the CPU: two worker processes over gloo, each holding half of the demo model.

Greedy fp32 replies are the single-process ones, token for token; a worker killed mid-reply
ends that reply with one clear line (the CLI) or WorkerLost (the engine), and the next load
works; no worker outlives the command, not even after a SIGTERM or a SIGKILL of its parent.
Every process started here carries a marker in its environment, so that what is left behind
is found however it was reparented.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from model_utils.errors import LoadError, WorkerLost
from model_utils.parallel.engine import TensorParallelEngine
from model_utils.runtime.generation_settings import GenerationSettings

from .helpers import HELLO, REPO_ROOT, cpu_request

PROMPT = ["--prompt", "What does nf4 mode do, and how do I switch modes?"]
GREEDY = ["chat", "--model", "demo", "--mode", "fp32", "--placement", "cpu", "--temperature",
          "0", "--max-new-tokens", "48", "--json", *PROMPT]
# Near-uniform sampling: with this seed the demo model runs for about 1900 tokens before EOS,
# seconds after the first one is printed (the tests check that the reply was cut short).
LONG_REPLY = ["chat", "--tp", "2", "--model", "demo", "--mode", "fp32", "--placement", "cpu",
              "--temperature", "20", "--top-p", "1", "--top-k", "0", "--seed", "1",
              "--max-new-tokens", "4000", *PROMPT]
MARKER = "QWEN_CHAT_TP_TEST"


def _env(marker: str) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", MARKER: marker}


def _marked(marker: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(MARKER) == marker and process.status() != "zombie":
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _assert_none_left(marker: str, within_s: float = 15.0) -> None:
    deadline = time.monotonic() + within_s
    while (left := _marked(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, [p.cmdline() for p in left]


def _cli(args: list[str], marker: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "model_utils", *args], cwd=REPO_ROOT,
                          env=_env(marker), capture_output=True, text=True, timeout=300)


def _workers(parent: psutil.Process, count: int, timeout_s: float = 120.0):
    """The parent's worker processes (spawn children; not multiprocessing's resource tracker),
    once all `count` are there."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = [c for c in parent.children() if "--multiprocessing-fork" in c.cmdline()]
        if len(workers) == count:
            return workers
        time.sleep(0.1)
    raise AssertionError(f"{count} workers did not start")


def _start_long_reply(marker: str) -> tuple[subprocess.Popen, list[psutil.Process]]:
    """The CLI streaming a long --tp 2 reply, once its first text is out."""
    cli = subprocess.Popen([sys.executable, "-m", "model_utils", *LONG_REPLY], cwd=REPO_ROOT,
                           env=_env(marker), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    workers = _workers(psutil.Process(cli.pid), 2)
    first = cli.stdout.read(1)  # blocks until the reply streams
    assert first, cli.stderr.read().decode()
    return cli, workers


def test_cli_tp2_gives_the_single_process_greedy_reply():
    marker = uuid.uuid4().hex
    with ThreadPoolExecutor(2) as pool:
        single, split = pool.map(lambda extra: _cli([*GREEDY, *extra], marker),
                                 [[], ["--tp", "2"]])
    assert single.returncode == 0, single.stderr
    assert split.returncode == 0, split.stderr
    one, two = json.loads(single.stdout), json.loads(split.stdout)
    assert two["decode_path"].startswith("tensor-parallel") and "2 workers" in two["placement"]
    assert one["new_tokens"] > 10
    for key in ("text", "reasoning", "new_tokens", "prompt_tokens", "finish_reason"):
        assert two[key] == one[key], key
    assert split.stderr == ""
    _assert_none_left(marker)


def test_cli_worker_killed_mid_reply_ends_it_with_one_line():
    marker = uuid.uuid4().hex
    cli, workers = _start_long_reply(marker)
    workers[1].kill()
    out, err = cli.communicate(timeout=120)
    err = err.decode()
    assert cli.returncode == 1, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: WorkerLost: tp-worker-1"), err
    assert "stopped while replying" in lines[0]
    _assert_none_left(marker)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_no_worker_outlives_its_parent(signum):
    marker = uuid.uuid4().hex
    cli, workers = _start_long_reply(marker)
    cli.send_signal(signum)
    _out, err = cli.communicate(timeout=60)
    # SIGTERM: the workers are stopped and the command exits as a shell reports it, quietly.
    assert cli.returncode == (143 if signum == signal.SIGTERM else -signum), err
    if signum == signal.SIGTERM:
        assert err == b"", err
    _assert_none_left(marker)


def test_engine_survives_a_lost_worker_and_loads_again(demo_path):
    engine = TensorParallelEngine(2)
    try:
        status = engine.load(cpu_request("fp32"))
        assert status["tp"] == 2 and len(status["shard_gb"]) == 2
        full_gb = sum(p.stat().st_size for p in demo_path.glob("*.safetensors")) / 1e9
        # Each worker holds less than the whole model (embeddings and lm_head are whole).
        assert all(shard < 0.9 * full_gb for shard in status["shard_gb"]), status
        greedy = GenerationSettings(temperature=0.0, max_new_tokens=16)
        before = engine.generate_text(HELLO, greedy)
        long = GenerationSettings(temperature=0.0, max_new_tokens=3000, min_new_tokens=3000)
        killed = threading.Event()
        with pytest.raises(WorkerLost, match="stopped while replying"):
            for _update in engine.chat(HELLO, long):
                if not killed.is_set():
                    os.kill(engine.group.processes[1].pid, signal.SIGKILL)
                    killed.set()
        assert engine.status()["loaded"] is False
        assert engine.group is None
        engine.load(cpu_request("fp32"))
        after = engine.generate_text(HELLO, greedy)
        assert after.answer == before.answer and after.reasoning == before.reasoning
        assert after.stats.new_tokens == before.stats.new_tokens > 0
    finally:
        group = engine.group
        pids = [p.pid for p in group.processes] if group else []
        engine.unload()
        assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
                       for pid in pids)


def test_engine_config_tp_picks_the_engine():
    from model_utils.engine_config import EngineConfig
    from model_utils.engine_factory import build_engine
    from model_utils.errors import InvalidParameter

    engine = build_engine(EngineConfig(tp=2))  # no model yet: no worker is started
    assert isinstance(engine, TensorParallelEngine) and engine.group is None
    with pytest.raises(InvalidParameter, match="tp"):
        EngineConfig(tp=0)  # refused as the config is made, before any engine


def test_tp_refuses_what_it_cannot_split():
    engine = TensorParallelEngine(3)  # the demo model has 4 heads and 2 key/value heads
    with pytest.raises(LoadError, match="do not split evenly over 3"):
        engine.load(cpu_request("fp32"))
    with pytest.raises(LoadError, match="nf4 is not split"):
        TensorParallelEngine(2).load(cpu_request("nf4"))
    assert engine.group is None


def test_engine_tp2_greedy_equals_the_single_process_engine(load_demo):
    single = load_demo("fp32")
    split = TensorParallelEngine(2)
    conversations = [HELLO, [{"role": "user", "content": "How do I switch the mode?"}],
                     [{"role": "user", "content": "What do the memory cards show?"}]]
    greedy = GenerationSettings(temperature=0.0, max_new_tokens=40)
    try:
        split.load(cpu_request("fp32"))
        for messages in conversations:
            for thinking in (True, False):
                one = single.generate_text(messages, greedy, thinking=thinking)
                two = split.generate_text(messages, greedy, thinking=thinking)
                assert (two.reasoning, two.answer) == (one.reasoning, one.answer), messages
                assert two.stats.new_tokens == one.stats.new_tokens > 0
    finally:
        split.unload()
