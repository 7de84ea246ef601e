"""Load test of a running chat app: N clients x M requests against its /chat endpoint (through
gradio_client) or its OpenAI-compatible /v1/chat/completions (--api openai).

    python tools/load_test.py --url http://127.0.0.1:7860 --clients 8 --requests 4 \\
        --max-new-tokens 64 --json load.json

Each client is its own session (as separate browser tabs or scripts would be) and sends its
requests one after another, each to a distinct message, streaming the reply. At the end it
reports:

- errors: requests that raised (an error status, a refused or dropped connection, a timeout);
- lost: replies whose stream ended without the final update (done=True with stats; with
  --api openai, without [DONE] and the usage);
- truncated: replies that ended for another reason than EOS or max_new_tokens, that hit the
  length limit short of max_new_tokens, or whose final text is shorter than what was streamed;
- aggregate tokens/s (new tokens of all replies over the wall time from the moment every
  client is connected to the last reply's end), each
  reply's decode speed (as the server measured it; with --api openai as the client saw it),
  median and slowest, latency percentiles, and
  what the web layer adds (the client's whole-reply time minus the server's own, and how many
  streamed updates a reply arrived in): time to first streamed text as the client sees it (TTFT), the server's
  own TTFT, and the time to the whole reply.

The exit status is 0 only when errors, lost and truncated are all 0 (1 otherwise, 2 for bad
arguments). It only talks to this machine: a URL whose host is not a loopback address (or
"localhost") is refused before anything is sent; and it is bounded: at most 64 clients x 100
requests, max_new_tokens <= 4096, and --timeout seconds for the whole run, after which the
requests still running are cancelled and counted as errors. Needs only gradio_client (and
httpx, which comes with it).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

MAX_CLIENTS = 64
MAX_REQUESTS = 100
MAX_NEW_TOKENS = 4096
MAX_TIMEOUT_S = 3600
MAX_PROMPT_WORDS = 4096
POLL_S = 0.005
FILLER = ("The waves rolled in from the grey horizon while the old sailor mended his nets "
          "and watched the gulls circle above the harbour.")


@dataclass
class Result:
    client: int
    request: int
    ok: bool = False
    error: str = ""
    lost: bool = False
    truncated: str = ""  # why, when the reply looks cut short
    new_tokens: int = 0
    prompt_tokens: int = 0
    tok_s: float | None = None  # the server's decode speed for this reply
    finish_reason: str = ""
    ttft_s: float | None = None  # client side: submission to the first streamed update
    server_ttft_ms: float | None = None
    total_s: float | None = None
    server_total_s: float | None = None  # the server's own time for the reply
    updates: int = 0


@dataclass
class Report:
    url: str
    clients: int
    requests_per_client: int
    max_new_tokens: int
    replies: int = 0
    errors: int = 0
    lost: int = 0
    truncated: int = 0
    wall_s: float = 0.0
    new_tokens: int = 0
    aggregate_tok_s: float = 0.0
    prompt_tokens_p50: float | None = None
    reply_tok_s_p50: float | None = None  # each user's decode speed (server's; openai: client's)
    reply_tok_s_min: float | None = None
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    server_ttft_p50_ms: float | None = None
    server_ttft_p99_ms: float | None = None
    latency_p50_s: float | None = None
    latency_p99_s: float | None = None
    # What the web layer adds: the client's whole-reply time minus the server's own.
    serving_overhead_p50_s: float | None = None
    serving_overhead_p99_s: float | None = None
    updates_per_reply_p50: float | None = None
    error_samples: list[str] = field(default_factory=list)
    truncated_samples: list[str] = field(default_factory=list)


def loopback_url(url: str) -> str:
    """The URL if its host is this machine's loopback; ValueError otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    host = parts.hostname
    if host != "localhost":
        try:
            if not ipaddress.ip_address(host).is_loopback:
                raise ValueError
        except ValueError:
            raise ValueError(f"refusing {host!r}: this load test only talks to a loopback "
                             "address (127.0.0.1, ::1 or localhost)") from None
    return url


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of the values, None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n q / 100)
    return ordered[int(rank) - 1]


def one_request(client, result: Result, message: str, settings: dict, deadline: float,
                jobs: list, lock: threading.Lock) -> None:
    start = time.perf_counter()
    job = client.submit(message, [], settings, "", False, api_name="/chat")
    with lock:
        jobs.append(job)
    final, longest, seen = None, 0, 0
    # Polled every POLL_S rather than iterated: gradio_client's iterator checks for a new
    # update every millisecond, and 32 of them spend cores that the server on the same machine
    # needs (measured: 2/3 of a core for 8 clients). TTFT is then known to within POLL_S.
    while True:
        finished = job.done()
        outputs = job.outputs()
        now = time.perf_counter()
        for update in outputs[seen:]:
            if result.ttft_s is None:
                result.ttft_s = now - start
            result.updates += 1
            longest = max(longest, len(update.get("answer") or ""))
            if update.get("done"):
                final = update
        seen = len(outputs)
        if finished:
            break
        if now > deadline:
            job.cancel()
            raise TimeoutError("the run's --timeout passed before the reply ended")
        time.sleep(POLL_S)
    if final is None:
        job.result()  # raises the server's error, if that is why the stream ended
    result.total_s = time.perf_counter() - start
    if final is None or not final.get("stats"):
        result.lost = True
        return
    stats = final["stats"]
    result.new_tokens = int(stats.get("new_tokens") or 0)
    result.prompt_tokens = int(stats.get("prompt_tokens") or 0)
    result.tok_s = stats.get("tok_s")
    result.server_total_s = stats.get("total_s")
    result.finish_reason = stats.get("finish_reason") or ""
    result.server_ttft_ms = stats.get("ttft_ms")
    judge(result, settings["max_new_tokens"])
    if not result.truncated and len(final.get("answer") or "") < longest:
        result.truncated = "the final answer is shorter than a streamed one"
    result.ok = not result.truncated


def judge(result: Result, wanted: int) -> None:
    """Mark a reply that ended for another reason than EOS or its full max_new_tokens."""
    if result.finish_reason not in ("eos", "length"):
        result.truncated = f"finished by {result.finish_reason or 'nothing'}"
    elif result.finish_reason == "length" and result.new_tokens != wanted:
        result.truncated = f"{result.new_tokens} of {wanted} tokens at the length limit"
    result.ok = not result.truncated


def one_openai_request(client, result: Result, message: str, settings: dict,
                       deadline: float) -> None:
    """The same request through /v1/chat/completions, streamed as server-sent events. The
    server's own timings are not in that format: TTFT and decode speed are the client's."""
    body = {"messages": [{"role": "user", "content": message}], "stream": True,
            "max_tokens": settings["max_new_tokens"], "temperature": settings["temperature"],
            "enable_thinking": False, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first_at = last_at = None
    finish, usage, ended = None, None, False
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            now = time.perf_counter()
            if now > deadline:
                raise TimeoutError("the run's --timeout passed before the reply ended")
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                ended = True
                break
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise RuntimeError(event["error"].get("message"))
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                delta = choice.get("delta", {})
                if delta.get("content") or delta.get("reasoning_content"):
                    first_at = first_at or now
                    last_at = now
                    result.updates += 1
                finish = choice.get("finish_reason") or finish
    result.total_s = time.perf_counter() - start
    if not ended or usage is None:
        result.lost = True
        return
    result.ttft_s = first_at - start if first_at else None
    result.new_tokens = int(usage.get("completion_tokens") or 0)
    result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    if first_at and last_at > first_at:
        result.tok_s = (result.new_tokens - 1) / (last_at - first_at)
    result.finish_reason = {"stop": "eos"}.get(finish, finish or "")
    judge(result, settings["max_new_tokens"])


def connect(args: argparse.Namespace):
    """One client: a gradio_client session, or an HTTP client that has listed the models."""
    if args.api == "gradio":
        from gradio_client import Client

        return Client(args.url, verbose=False, auth=args.auth, download_files=False)
    import httpx

    headers = {"Authorization": f"Bearer {args.auth[0]}:{args.auth[1]}"} if args.auth else {}
    client = httpx.Client(base_url=args.url, headers=headers, timeout=args.timeout)
    client.get("/v1/models").raise_for_status()
    return client


def run_client(index: int, args: argparse.Namespace, results: list[Result], deadline: float,
               jobs: list, lock: threading.Lock, connected: threading.Barrier) -> None:
    """Connect, wait until every client has (so that all start sending together, as users
    whose pages are already open), then send this client's requests one after another."""
    mine = [Result(index, r) for r in range(args.requests)]
    results.extend(mine)  # list.extend is atomic under the GIL
    client = None
    try:
        client = connect(args)
    except Exception as error:  # noqa: BLE001 - the report names it
        for result in mine:
            result.error = f"connect: {type(error).__name__}: {error}"
    try:
        connected.wait(timeout=max(0.0, deadline - time.perf_counter()))
    except threading.BrokenBarrierError:
        pass  # a client took too long to connect: the others go on
    if client is None:
        return
    settings = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    for result in mine:
        if time.perf_counter() > deadline:
            result.error = "not sent: the run's --timeout passed"
            continue
        message = (f"Load test, client {index}, request {result.request}: "
                   "tell me a long story about the sea.")
        words = message.split()
        while len(words) < args.prompt_words:
            words += FILLER.split()
        message = " ".join(words[:max(args.prompt_words, len(message.split()))])
        try:
            if args.api == "gradio":
                one_request(client, result, message, settings, deadline, jobs, lock)
            else:
                one_openai_request(client, result, message, settings, deadline)
        except Exception as error:  # noqa: BLE001 - counted, the run goes on
            result.error = f"{type(error).__name__}: {str(error)[:300]}"


def summarize(args: argparse.Namespace, results: list[Result], wall_s: float) -> Report:
    report = Report(args.url, args.clients, args.requests, args.max_new_tokens, wall_s=wall_s)
    done = [r for r in results if not r.error and not r.lost]
    report.replies = len(done)
    report.errors = sum(bool(r.error) for r in results)
    report.lost = sum(r.lost for r in results)
    report.truncated = sum(bool(r.truncated) for r in done)
    report.new_tokens = sum(r.new_tokens for r in done)
    report.aggregate_tok_s = round(report.new_tokens / max(wall_s, 1e-9), 2)
    report.prompt_tokens_p50 = percentile([r.prompt_tokens for r in done], 50)
    speeds = [r.tok_s for r in done if r.tok_s]
    report.reply_tok_s_p50 = percentile(speeds, 50)
    report.reply_tok_s_min = min(speeds) if speeds else None
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    server = [r.server_ttft_ms for r in done if r.server_ttft_ms is not None]
    total = [r.total_s for r in done if r.total_s is not None]
    report.ttft_p50_s, report.ttft_p99_s = percentile(ttft, 50), percentile(ttft, 99)
    report.server_ttft_p50_ms = percentile(server, 50)
    report.server_ttft_p99_ms = percentile(server, 99)
    report.latency_p50_s, report.latency_p99_s = percentile(total, 50), percentile(total, 99)
    overhead = [r.total_s - r.server_total_s for r in done
                if r.total_s is not None and r.server_total_s is not None]
    report.serving_overhead_p50_s = percentile(overhead, 50)
    report.serving_overhead_p99_s = percentile(overhead, 99)
    report.updates_per_reply_p50 = percentile([r.updates for r in done], 50)
    report.error_samples = sorted({r.error for r in results if r.error})[:5]
    report.truncated_samples = sorted({r.truncated for r in done if r.truncated})[:5]
    return report


def print_report(report: Report) -> None:
    def fmt(value, unit=""):
        return "-" if value is None else f"{value:.3f}{unit}"

    print(f"{report.clients} clients x {report.requests_per_client} requests against "
          f"{report.url} (max_new_tokens {report.max_new_tokens})")
    print(f"replies {report.replies}, errors {report.errors}, lost {report.lost}, "
          f"truncated {report.truncated}")
    print(f"{report.new_tokens} new tokens in {report.wall_s:.2f} s: "
          f"{report.aggregate_tok_s:.1f} tok/s aggregate; prompts of "
          f"{fmt(report.prompt_tokens_p50)} tokens (p50)")
    print(f"each reply's decode speed: p50 {fmt(report.reply_tok_s_p50, ' tok/s')}, "
          f"slowest {fmt(report.reply_tok_s_min, ' tok/s')}")
    print(f"TTFT (client) p50 {fmt(report.ttft_p50_s, ' s')}, p99 {fmt(report.ttft_p99_s, ' s')};"
          f" server TTFT p50 {fmt(report.server_ttft_p50_ms, ' ms')}, "
          f"p99 {fmt(report.server_ttft_p99_ms, ' ms')}")
    print(f"whole reply p50 {fmt(report.latency_p50_s, ' s')}, "
          f"p99 {fmt(report.latency_p99_s, ' s')}; of which the web layer (client time minus "
          f"the server's) p50 {fmt(report.serving_overhead_p50_s, ' s')}, "
          f"p99 {fmt(report.serving_overhead_p99_s, ' s')}; "
          f"{fmt(report.updates_per_reply_p50)} streamed updates per reply (p50)")
    for sample in report.error_samples:
        print(f"error: {sample}")
    for sample in report.truncated_samples:
        print(f"truncated: {sample}")


def bounded_int(low: int, high: int):
    def parse(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}")
        return value
    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tools/load_test.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:7860",
                        help="the running app (loopback only)")
    parser.add_argument("--clients", type=bounded_int(1, MAX_CLIENTS), default=4)
    parser.add_argument("--requests", type=bounded_int(1, MAX_REQUESTS), default=2,
                        help="requests per client, sent one after another")
    parser.add_argument("--max-new-tokens", type=bounded_int(1, MAX_NEW_TOKENS), default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--api", choices=("gradio", "openai"), default="gradio",
                        help="gradio: the /chat endpoint through gradio_client; openai: "
                             "/v1/chat/completions, streamed as server-sent events")
    parser.add_argument("--prompt-words", type=bounded_int(0, MAX_PROMPT_WORDS), default=0,
                        help="lengthen each message to this many words (tokens per word "
                             "depend on the tokenizer; the report gives the server's count)")
    parser.add_argument("--timeout", type=bounded_int(1, MAX_TIMEOUT_S), default=300,
                        help="seconds for the whole run")
    parser.add_argument("--auth", metavar="USER:PASSWORD",
                        help="a login, for an app run with --auth")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    args = parser.parse_args(argv)
    try:
        loopback_url(args.url)
    except ValueError as error:
        parser.error(str(error))
    if args.auth:
        user, sep, password = args.auth.partition(":")
        if not sep:
            parser.error("--auth: expected USER:PASSWORD")
        args.auth = (user, password)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: list[Result] = []
    jobs: list = []
    lock = threading.Lock()
    deadline = time.perf_counter() + args.timeout
    # Connecting (a gradio_client fetches the app's config and API description) costs the
    # client process ~0.2 s of CPU each; it is done before the clock starts, so that the wall
    # time measures the server and not how fast this process sets up 32 clients.
    connected = threading.Barrier(args.clients + 1)
    threads = [threading.Thread(target=run_client, daemon=True,
                                args=(i, args, results, deadline, jobs, lock, connected))
               for i in range(args.clients)]
    for thread in threads:
        thread.start()
    try:
        connected.wait(timeout=max(0.0, deadline - time.perf_counter()))
    except threading.BrokenBarrierError:
        pass
    start = time.perf_counter()
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.perf_counter()) + 10)
    if any(thread.is_alive() for thread in threads):
        with lock:
            for job in jobs:
                job.cancel()
        for result in results:
            if not (result.ok or result.error or result.lost or result.truncated):
                result.error = "unfinished when the run's --timeout passed"
    report = summarize(args, sorted(results, key=lambda r: (r.client, r.request)),
                       time.perf_counter() - start)
    print_report(report)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"report": asdict(report), "requests": [asdict(r) for r in results]},
                      out, indent=2)
    return 0 if report.errors == report.lost == report.truncated == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
