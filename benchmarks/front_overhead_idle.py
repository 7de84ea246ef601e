"""What the front adds per request when nothing else wants the CPU: this app with --backend in
front of tests/ui/fake_model_server.py (an OpenAI-compatible server that answers at once, no
model), against that server direct; one streamed request at a time, alternating.

    python benchmarks/front_overhead_idle.py [--requests 40] [--rounds 2]

remote_overhead.py measures the same in front of a real model server (32 streams on the GPU
host); on a 2-core CPU its model server's decoding competes with the front for the cores, and
this run shows the front's cost without that.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "ui"))

from fake_model_server import MODEL, FakeModelServer  # noqa: E402

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed_request(base: str) -> tuple[float, float]:
    """(ms to the first streamed chunk with text, ms to the end) of one request."""
    start, first = time.perf_counter(), None
    with httpx.stream("POST", base + "/chat/completions", json=BODY, timeout=30) as response:
        for line in response.iter_lines():
            if first is None and line.startswith("data: ") and "content" in line:
                first = time.perf_counter() - start
    return first * 1000, (time.perf_counter() - start) * 1000


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=40, help="per round and path")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    fake, port = FakeModelServer().start(), free_port()
    log = Path(tempfile.mkdtemp(prefix="front-idle-")) / "server.log"
    app = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--backend", fake.url,
                            "--port", str(port), "--log-file", str(log)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    front = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(front + "/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"the front did not start (see {log})")
            time.sleep(0.5)
        for _ in range(5):  # first-request costs of both
            timed_request(front)
        runs: dict[str, list[tuple[float, float]]] = {"direct": [], "front": []}
        for _ in range(args.rounds):
            for path, base in (("direct", fake.url), ("front", front)):
                runs[path] += [timed_request(base) for _ in range(args.requests)]
        result = {path: {"first_chunk_ms_p50": round(statistics.median(r[0] for r in rows), 3),
                         "whole_ms_p50": round(statistics.median(r[1] for r in rows), 3),
                         "requests": len(rows)} for path, rows in runs.items()}
        result["overhead_ms_per_request"] = round(
            result["front"]["whole_ms_p50"] - result["direct"]["whole_ms_p50"], 3)
        print(json.dumps(result, indent=1))
    finally:
        app.terminate()
        app.wait(timeout=30)
        fake.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
