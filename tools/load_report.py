"""The load test's results: one Result per request, the Report over all of them (percentiles,
aggregate speed, what the web layer added), and its printout. Used by load_test.py."""

from __future__ import annotations

from dataclasses import dataclass, field


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


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of the values, None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n q / 100)
    return ordered[int(rank) - 1]


def summarize(args, results: list[Result], wall_s: float) -> Report:
    """The report of a run; `args` are load_test's parsed flags."""
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
