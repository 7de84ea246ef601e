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
requests still running are cancelled and counted as errors. Every generation setting has its
flag (--temperature, --top-p, --top-k, --max-new-tokens, --repetition-penalty, --seed: the
settings' declarations, model_utils/runtime/generation_settings.py); unset ones are the
model's defaults. Needs gradio_client (and httpx, which comes with it) and this repository
(not torch).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from urllib.parse import urlsplit

# Run as a script (python tools/load_test.py): the settings' declarations are the repository's.
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from load_clients import connect, one_openai_request, one_request  # noqa: E402
from load_report import Result, print_report, summarize  # noqa: E402

from model_utils.errors import InvalidParameter
from model_utils.runtime.generation_settings import add_setting_flags, public, settings_from_args

MAX_CLIENTS = 64
MAX_REQUESTS = 100
MAX_NEW_TOKENS = 4096
MAX_TIMEOUT_S = 3600
MAX_PROMPT_WORDS = 4096
FILLER = ("The waves rolled in from the grey horizon while the old sailor mended his nets "
          "and watched the gulls circle above the harbour.")


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
    settings = {s.name: getattr(args.settings, s.name) for s in public()
                if getattr(args.settings, s.name) is not None}
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
    # The generation settings' own flags; a load test defaults to short greedy replies.
    add_setting_flags(parser.add_argument_group("settings of every request"),
                      defaults={"max_new_tokens": 32, "temperature": 0.0})
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
    if not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        parser.error(f"argument --max-new-tokens: must be between 1 and {MAX_NEW_TOKENS}")
    try:
        args.settings = settings_from_args(args)
    except InvalidParameter as error:
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
