"""The benchmark's results: one BenchRow per mode and batch, as a markdown table, a summary of
the few figures a user compares, and a chart."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class BenchRow:
    mode: str
    batch: int
    decode_path: str
    load_s: float
    weights_gb: float
    peak_gb: dict  # per device: the most tensors held at once, from the load to the last reply
    peak_reserved_gb: dict  # the same for the allocator (caches, CUDA-graph pools)
    kv_gb: float | None  # the engine's K/V caches (batch cache and prefill row)
    over_weights_kv_pct: float | None  # peak over weights + KV caches, CUDA only
    memory_stages: dict  # CUDA memory after each step of the load (engine status)
    ttft_ms: float
    tok_s: float  # per stream, decode phase
    aggregate_tok_s: float  # batch > 1: all tokens / wall time from submission to the last one
    x_one_plain: float | None  # aggregate over one plain-generate stream's tok/s
    stream_tok_s: float | None  # through engine.chat (text streaming), batch 1 only
    peer_load_s: float
    peer_ttft_ms: float
    peer_tok_s: float
    peer_aggregate_tok_s: float
    speedup: float  # aggregate tokens/s, engine over peer
    ttft_ratio: float  # engine TTFT over peer TTFT
    # Greedy tokens equal to plain generate's: asked in fp32 only (None in other modes), where
    # two correct decoders agree; in 16-bit they part at near-ties (see logprob_check.py).
    greedy_match: bool | None
    first_mismatch: list  # per compared prompt: the first token that differs, None when equal
    # The same comparison for transformers' own static KV cache (generate with
    # cache_implementation="static", uncompiled) against its default cache: how far two correct
    # implementations of greedy decoding agree in this precision.
    peer_static_first_mismatch: list
    batch_match: bool | None = None  # concurrent streams == the engine's single streams
    # logprob_check: greedy replies of `batch` concurrent requests against plain generate's,
    # close by top-k log-probabilities where they part; None when not measured.
    logprobs_close: bool | None = None
    # Teacher-forced: engine's mean KL against fp32 over plain's (<= 1.1 passes).
    logit_error_ratio: float | None = None
    logprobs: dict = field(default_factory=dict)  # the details of both checks
    # Next-token distributions against the fp32 model's, teacher-forced (quality.py)
    kl_vs_fp32: float | None = None
    top1_vs_fp32: float | None = None


COLUMNS = ["mode", "batch", "decode_path", "load_s", "weights_gb", "ttft_ms", "peer_ttft_ms",
           "tok_s", "peer_tok_s", "aggregate_tok_s", "peer_aggregate_tok_s", "speedup",
           "x_one_plain", "stream_tok_s", "greedy_match", "batch_match", "logprobs_close",
           "logit_error_ratio", "over_weights_kv_pct", "kl_vs_fp32", "top1_vs_fp32"]


def markdown_table(rows: list[BenchRow]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " | peak_gb |",
             "|" + "---|" * (len(COLUMNS) + 1)]
    for row in rows:
        d = asdict(row)
        peak = ", ".join(f"{k} {v}" for k, v in row.peak_gb.items())
        lines.append("| " + " | ".join(str(d[c]) for c in COLUMNS) + f" | {peak} |")
    notes = [greedy_note(row) for row in rows if row.batch == 1 and row.first_mismatch
             and any(i is not None for i in row.first_mismatch)]
    return "\n".join(lines) + "".join("\n\n" + note for note in notes)


def details_table(rows: list[BenchRow]) -> str:
    """Every figure of markdown_table for the page: one line per figure and one column per
    run, so that it stays readable in a page's width however many figures there are ("-"
    where one does not apply), then the greedy notes."""
    lines = ["| figure | " + " | ".join(f"{r.mode}, batch {r.batch}" for r in rows) + " |",
             "|" + "---|" * (len(rows) + 1)]
    dicts = [asdict(row) for row in rows]
    for column in COLUMNS[2:]:
        lines.append(f"| {column} | " + " | ".join(_cell(d[column]) for d in dicts) + " |")
    lines.append("| peak_gb | " + " | ".join(
        ", ".join(f"{k} {v}" for k, v in r.peak_gb.items()) or "-" for r in rows) + " |")
    notes = [greedy_note(row) for row in rows if row.batch == 1 and row.first_mismatch
             and any(i is not None for i in row.first_mismatch)]
    return "\n".join(lines) + "".join("\n\n" + note for note in notes)


def speed_note(rows: list[BenchRow]) -> str:
    """What x plain generate to expect where the engine decodes eagerly (the CPU), so that a
    figure near 1 does not read as a fault."""
    if not any(row.decode_path == "eager" for row in rows):
        return ""
    return ("On this eager path (the CPU, or a mode without CUDA graphs) the engine runs the "
            "same forward passes as plain generate: expect **x plain generate near 1** (0.8-1.1 "
            "on the demo model). The speed-up is the GPU's compiled CUDA-graph path "
            "(BENCHMARKS.md).")


def greedy_note(row: BenchRow) -> str:
    """Where greedy tokens part, with this run's reference (plain generate against
    transformers' own static cache, two correct decoders on the same weights) and what the
    logprob check made of it."""
    def tokens(found: list) -> str:
        return ", ".join("none" if i is None else str(i) for i in found)

    where = (f"{row.mode}: the greedy tokens first differ from plain generate's at token "
             f"{tokens(row.first_mismatch)} (one per prompt); transformers' own static cache "
             f"differs from plain generate at token {tokens(row.peer_static_first_mismatch)}. ")
    if row.mode == "fp32":  # equal on the H200 (3 prompts x 256 tokens) and in the CPU tests
        return where + "In fp32 the two agreed wherever measured: this one is worth reporting."
    verdict = {True: "the log-probabilities are close there (a near-tie)",
               False: "the log-probabilities are NOT close there: worth reporting",
               None: "the log-probabilities were not compared"}[row.logprobs_close]
    return where + (f"In low precision any other order of the same arithmetic can flip a near "
                    f"tie between two tokens, and from there the replies part; {verdict}.")


# -- the few figures a user compares ---------------------------------------------------------
SUMMARY = [("mode", "Mode"), ("batch", "Batch"), ("ttft_ms", "Time to first token (ms)"),
           ("tok_s", "Tokens/s per reply"), ("aggregate_tok_s", "Tokens/s, all replies"),
           ("speedup", "x plain generate"), ("logprobs_close", "Logprobs close"),
           ("logit_error_ratio", "Logit error ratio"), ("peak", "Peak GB")]


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def summary_table(rows: list[BenchRow]) -> str:
    """A short markdown table: units in the headers, "-" where a figure does not apply."""
    lines = ["| " + " | ".join(title for _, title in SUMMARY) + " |",
             "|" + "---|" * len(SUMMARY)]
    for row in rows:
        d = asdict(row)
        d["peak"] = round(sum(row.peak_gb.values()), 2) if row.peak_gb else None
        d["aggregate_tok_s"] = row.aggregate_tok_s if row.batch > 1 else None
        lines.append("| " + " | ".join(_cell(d[key]) for key, _ in SUMMARY) + " |")
    return "\n".join(lines)


def chart_figure(rows: list[BenchRow]):
    """A matplotlib figure: aggregate tokens/s of the engine and the peer, per mode and batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.mode}\nbatch {r.batch}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(rows)), 4))
    ax.bar([i - 0.2 for i in x], [r.aggregate_tok_s for r in rows], 0.4, label="this engine")
    ax.bar([i + 0.2 for i in x], [r.peer_aggregate_tok_s for r in rows], 0.4,
           label="plain model.generate")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("tokens/s (all streams)")
    ax.set_title("Decode speed, same process, greedy")
    ax.legend()
    fig.tight_layout()
    return fig


def save_chart(rows: list[BenchRow], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = chart_figure(rows)
    fig.savefig(path, dpi=100)
    plt.close(fig)
