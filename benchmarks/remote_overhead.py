"""What this app adds in front of a model server: per request and per token, at 32 streams.

One host: this app serving a model of the Qwen2.5-7B-Instruct shape (random bf16 weights) on
cuda:0 is the model server; a second instance with --backend in front of it. tools/load_test.py
(--api openai, greedy, streamed) runs the same clients straight at the server and through the
front, alternating, then half of them each way at once (the fairest comparison: both halves
share every decode step of the server). Per request, from the load test's own timings:

    TTFT         submission to the first streamed text
    per token    (whole reply - TTFT) / (tokens - 1)

overhead per request = front TTFT - direct TTFT (medians); overhead per token = front per-token
- direct per-token (medians). Targets: <= 3 ms per request, <= 0.2 ms per token. Separate runs
differ by the server's own run-to-run spread (reported beside them); the mixed run and the
front's own view (its server.log gives each reply's TTFT and tokens/s as the front received them
from the server: the client's figures through the front minus those, over the same requests, are
what the front's own processing adds, without the extra hop) do not depend on it.

    python benchmarks/remote_overhead.py --out "$OUT"          # on the GPU host (~5 minutes)
    python benchmarks/remote_overhead.py --out /tmp/ro          # on a CPU: the demo model, small

Writes OUT/remote_overhead.json, OUT/remote_overhead.md, both apps' logs and every load-test
report. Needs no network beyond loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Qwen2.5-7B-Instruct's published config.json (the shape; the weights are random).
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
    "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
    "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
    "max_position_embeddings": 32768, "max_window_layers": 28, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 131072, "use_sliding_window": False,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "bos_token_id": 151643, "eos_token_id": 151645, "attention_dropout": 0.0,
    "initializer_range": 0.02,
}
BUDGET_S = 450  # the whole run, model build and compile included, stays under 8 minutes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(flags: list[str], port: int, out: Path, name: str) -> subprocess.Popen:
    console = (out / f"{name}-console.txt").open("w")
    return subprocess.Popen([sys.executable, "app.py", "--port", str(port), "--log-file",
                             str(out / f"{name}.log"), *flags], cwd=ROOT, stdout=console,
                            stderr=subprocess.STDOUT,
                            env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"})


def wait_serving(url: str, proc: subprocess.Popen, deadline: float) -> None:
    """Until /v1/models lists a model (the server's load includes compiling its decode step)."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: the app exited ({proc.returncode}); see its console file")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as response:
                if json.load(response)["data"]:
                    return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(1)
    raise SystemExit(f"{url} did not serve a model in time")


def load_test(url: str, clients: int, args, out: Path, name: str, tokens: int | None = None,
              requests: int | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "tools/load_test.py", "--url", url, "--api", "openai",
         "--clients", str(clients), "--requests", str(requests or args.requests),
         "--max-new-tokens", str(tokens or args.new_tokens), "--prompt-words", "35",
         "--timeout", str(args.run_timeout), "--json", str(out / f"load-{name}.json")],
        cwd=ROOT, stdout=(out / f"load-{name}.txt").open("w"), stderr=subprocess.STDOUT)


def figures(out: Path, name: str) -> dict:
    data = json.loads((out / f"load-{name}.json").read_text())
    done = [r for r in data["requests"] if not r["error"] and not r["lost"]
            and r["ttft_s"] is not None and r["new_tokens"] > 1]
    ttft = [r["ttft_s"] * 1000 for r in done]
    per_token = [(r["total_s"] - r["ttft_s"]) * 1000 / (r["new_tokens"] - 1) for r in done]
    report = data["report"]
    return {"replies": len(done), "errors": report["errors"], "lost": report["lost"],
            "truncated": report["truncated"], "aggregate_tok_s": report["aggregate_tok_s"],
            "ttft_ms_p50": _median(ttft), "per_token_ms_p50": _median(per_token),
            "tokens_p50": _median([r["new_tokens"] for r in done])}


REPLY_LINE = re.compile(r"reply: model=.* via .*, (\d+) in / (\d+) out, ttft ([\d.]+) ms, "
                        r"([\d.]+) tok/s")


def front_replies(out: Path) -> list[tuple[int, float, float]]:
    """(new tokens, TTFT ms, tok/s) of each reply in the front's log, as it got them."""
    text = (out / "front.log").read_text(errors="replace") if (out / "front.log").exists() \
        else ""
    return [(int(m[2]), float(m[3]), float(m[4])) for m in REPLY_LINE.finditer(text)]


def upstream(replies: list[tuple[int, float, float]]) -> dict:
    done = [r for r in replies if r[0] > 1 and r[2] > 0]
    return {"replies": len(done), "ttft_ms_p50": _median([r[1] for r in done]),
            "per_token_ms_p50": _median([1000 / r[2] for r in done])}


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "remote-overhead"))
    parser.add_argument("--config", help="config.json of the server's model shape (default: "
                        "Qwen2.5-7B-Instruct's); GPU only")
    parser.add_argument("--clients", type=int, help="streams at once (default 32, CPU 4)")
    parser.add_argument("--requests", type=int, default=2, help="per client, one by one")
    parser.add_argument("--new-tokens", type=int, help="per reply (default 256, CPU 32)")
    parser.add_argument("--rounds", type=int, default=2, help="direct/front pairs")
    parser.add_argument("--run-timeout", type=int, default=120, help="s per load test")
    args = parser.parse_args()
    started = time.monotonic()
    deadline = started + BUDGET_S
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import torch

    cuda = torch.cuda.is_available()
    args.clients = args.clients or (32 if cuda else 4)
    args.new_tokens = args.new_tokens or (256 if cuda else 32)
    workdir = Path(tempfile.mkdtemp(prefix="remote-overhead-"))
    if cuda:
        from model_utils.bench.inputs import build_random_model

        config = Path(args.config) if args.config else workdir / "config.json"
        if not args.config:
            config.write_text(json.dumps(QWEN25_7B))
        model = str(build_random_model(config, workdir / "model", "cuda"))
        server_flags = ["--model", model, "--mode", "bf16", "--placement", "cuda:0"]
    else:
        server_flags = ["--model", "demo", "--mode", "fp32", "--placement", "cpu"]
    build_s = time.monotonic() - started
    server_port, front_port = free_port(), free_port()
    server_url = f"http://127.0.0.1:{server_port}"
    front_url = f"http://127.0.0.1:{front_port}"
    server = start_app([*server_flags, "--max-batch", str(args.clients), "--max-queue", "64"],
                       server_port, out, "server")
    front = start_app(["--backend", server_url + "/v1", "--max-batch", str(args.clients),
                       "--max-queue", "64"], front_port, out, "front")
    result: dict = {"device": torch.cuda.get_device_name(0) if cuda else "cpu",
                    "server_model": "Qwen2.5-7B-Instruct shape, random bf16" if cuda
                    else "demo (fp32, cpu)", "clients": args.clients,
                    "requests_per_client": args.requests, "new_tokens": args.new_tokens,
                    "build_s": round(build_s, 1)}
    try:
        run_all(args, out, result, server, front, server_url, front_url, deadline)
    except SystemExit as stop:  # an app that died or did not get ready: say so in the JSON
        result["error"] = str(stop)
    finally:
        for proc in (front, server):
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
    shutil.rmtree(workdir, ignore_errors=True)  # the 15 GB checkpoint
    summarize(result)
    result["wall_s"] = round(time.monotonic() - started, 1)
    (out / "remote_overhead.json").write_text(json.dumps(result, indent=2))
    (out / "remote_overhead.md").write_text(markdown(result))
    print(markdown(result))
    return 1 if result.get("error") else 0


def run_all(args, out: Path, result: dict, server, front, server_url: str, front_url: str,
            deadline: float) -> None:
    """Wait for both apps, warm up, then the alternating runs and the mixed one."""
    started = time.monotonic()
    wait_serving(server_url, server, deadline)
    wait_serving(front_url, front, deadline)
    result["apps_ready_s"] = round(time.monotonic() - started, 1)  # load + compile
    # Warm-up: connections, the server's first prompts of each shape, the front's imports.
    for url, name in ((server_url, "warmup-direct"), (front_url, "warmup-front")):
        load_test(url, args.clients, args, out, name, tokens=16, requests=1).wait()
    runs: dict[str, list[dict]] = {"direct": [], "front": []}
    for i in range(args.rounds):
        for path, url in (("direct", server_url), ("front", front_url)):
            if time.monotonic() > deadline - args.run_timeout:
                result["note"] = "stopped early: the time budget ran out"
                break
            name = f"{path}-{i}"
            logged = len(front_replies(out))
            load_test(url, args.clients, args, out, name).wait()
            runs[path].append(figures(out, name))
            if path == "front":
                runs[path][-1]["front_view"] = upstream(front_replies(out)[logged:])
    result["separate_runs"] = runs
    half = max(args.clients // 2, 1)
    if time.monotonic() < deadline - args.run_timeout:
        both = [load_test(server_url, half, args, out, "mixed-direct"),
                load_test(front_url, half, args, out, "mixed-front")]
        for proc in both:
            proc.wait()
        result["mixed_run"] = {"direct": figures(out, "mixed-direct"),
                               "front": figures(out, "mixed-front")}


def summarize(result: dict) -> None:
    """The overheads: from the alternating runs (medians of their medians) and the mixed run."""
    runs = result.get("separate_runs") or {}

    def over(path: str, key: str):
        values = [r[key] for r in runs.get(path, []) if r[key] is not None]
        return statistics.median(values) if values else None

    def spread(key: str):
        values = [r[key] for r in runs.get("direct", []) if r[key] is not None]
        return round(max(values) - min(values), 3) if len(values) > 1 else None

    overhead = {"separate": {
        "per_request_ms": _diff(over("front", "ttft_ms_p50"), over("direct", "ttft_ms_p50")),
        "per_token_ms": _diff(over("front", "per_token_ms_p50"),
                              over("direct", "per_token_ms_p50")),
        "direct_runs_differ_by_ms": {"per_request": spread("ttft_ms_p50"),
                                     "per_token": spread("per_token_ms_p50")}}}
    views = [r for r in runs.get("front", []) if r.get("front_view", {}).get("replies")]
    if views:
        overhead["front_processing"] = {
            "per_request_ms": round(statistics.median(
                r["ttft_ms_p50"] - r["front_view"]["ttft_ms_p50"] for r in views), 3),
            "per_token_ms": round(statistics.median(
                r["per_token_ms_p50"] - r["front_view"]["per_token_ms_p50"] for r in views), 3)}
    mixed = result.get("mixed_run")
    if mixed:
        overhead["mixed"] = {
            "per_request_ms": _diff(mixed["front"]["ttft_ms_p50"], mixed["direct"]["ttft_ms_p50"]),
            "per_token_ms": _diff(mixed["front"]["per_token_ms_p50"],
                                  mixed["direct"]["per_token_ms_p50"])}
    for entry in overhead.values():
        entry["meets_3ms_per_request"] = entry["per_request_ms"] is not None and \
            entry["per_request_ms"] <= 3
        entry["meets_0.2ms_per_token"] = entry["per_token_ms"] is not None and \
            entry["per_token_ms"] <= 0.2
    result["overhead"] = overhead


def markdown(result: dict) -> str:
    lines = [f"# Front-end overhead: {result['device']}, server {result['server_model']}",
             (f"{result['clients']} streams x {result['requests_per_client']} requests, "
             f"{result['new_tokens']} new tokens, greedy, /v1/chat/completions streamed"),
             "", ("| run | path | replies | errors | TTFT p50 (ms) | per token p50 (ms) | "
             "tok/s all |"), "|---|---|---|---|---|---|---|"]
    for path, rows in (result.get("separate_runs") or {}).items():
        for i, r in enumerate(rows):
            lines.append(f"| {i} | {path} | {r['replies']} | {r['errors']} | {r['ttft_ms_p50']} "
                         f"| {r['per_token_ms_p50']} | {r['aggregate_tok_s']} |")
    for path, r in (result.get("mixed_run") or {}).items():
        lines.append(f"| mixed | {path} | {r['replies']} | {r['errors']} | {r['ttft_ms_p50']} | "
                     f"{r['per_token_ms_p50']} | {r['aggregate_tok_s']} |")
    lines.append("")
    for kind, o in (result.get("overhead") or {}).items():
        lines.append(f"- overhead ({kind}): {o['per_request_ms']} ms per request "
                     f"(target <= 3: {o['meets_3ms_per_request']}), {o['per_token_ms']} ms per "
                     f"token (target <= 0.2: {o['meets_0.2ms_per_token']})")
        if (o.get("direct_runs_differ_by_ms") or {}).get("per_request") is not None:
            d = o["direct_runs_differ_by_ms"]
            lines.append(f"  (the direct runs alone differ by {d['per_request']} ms per request "
                         f"and {d['per_token']} ms per token: smaller differences are noise)")
    if result.get("note"):
        lines.append(f"- {result['note']}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
