"""Time to first token and tokens/s through a model server, one stream and N at once, measured
here (what a user of this app sees, network included).

    python -m model_utils.backends.bench --backend http://gpu-node:8000/v1 --streams 1,8,32
    python -m model_utils.backends.bench --backend http://127.0.0.1:7860/v1   # this app, local

The same code runs from the Benchmark tab when the app is the front end of a server. Pointed at
an instance of this app that loads the model itself, it measures the local engine the same way,
so the two can be compared. Greedy, thinking off, one prompt per stream.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

from model_utils.runtime.generation_settings import GenerationSettings

PROMPT = "Tell me a long story about the sea, the harbour and the old sailor who mended nets."
FILLER = " The waves rolled in from the grey horizon while the gulls circled above."


@dataclass
class RemoteBenchRow:
    streams: int
    replies: int
    errors: int
    ttft_ms_p50: float | None
    ttft_ms_max: float | None
    tok_s_per_stream_p50: float | None  # each reply's decode speed
    aggregate_tok_s: float  # every reply's tokens over the wall time
    new_tokens: int
    wall_s: float
    at_once: int = 0  # streams in flight together (fewer than `streams` where places are kept)
    error_samples: list[str] = field(default_factory=list)


def prompt_of(words: int, index: int) -> str:
    text = f"Stream {index}. {PROMPT}"
    while len(text.split()) < words:
        text += FILLER
    return " ".join(text.split()[:max(words, 4)])


def one_round(engine, streams: int, new_tokens: int, prompt_words: int,
              at_once: int | None = None) -> RemoteBenchRow:
    """`streams` replies, at most `at_once` of them in flight together (the others wait for
    one to end, here, without taking a place of the engine's)."""
    at_once = min(streams, at_once or streams)
    settings = GenerationSettings(temperature=0.0, max_new_tokens=new_tokens)
    results: list = [None] * streams
    start_together = threading.Barrier(streams)
    places = threading.Semaphore(at_once)

    def run(i: int) -> None:
        messages = [{"role": "user", "content": prompt_of(prompt_words, i)}]
        try:
            start_together.wait(timeout=60)
            with places:
                results[i] = engine.generate_text(messages, settings, thinking=False).stats
        except Exception as error:  # noqa: BLE001 - counted and shown in the row
            results[i] = f"{type(error).__name__}: {error}"

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(streams)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    stats = [r for r in results if not isinstance(r, str) and r is not None]
    errors = sorted({r for r in results if isinstance(r, str)})
    ttft = [s.ttft_ms for s in stats if s.new_tokens]
    speeds = [s.tok_s for s in stats if s.tok_s]
    tokens = sum(s.new_tokens for s in stats)
    return RemoteBenchRow(
        streams=streams, replies=len(stats), errors=streams - len(stats),
        ttft_ms_p50=round(statistics.median(ttft), 1) if ttft else None,
        ttft_ms_max=round(max(ttft), 1) if ttft else None,
        tok_s_per_stream_p50=round(statistics.median(speeds), 1) if speeds else None,
        aggregate_tok_s=round(tokens / wall, 1), new_tokens=tokens, wall_s=round(wall, 3),
        at_once=at_once, error_samples=errors[:3])


def bench_remote(engine, *, streams: tuple[int, ...] = (1, 8), new_tokens: int = 64,
                 prompt_words: int = 32, at_once: int | None = None) -> list[RemoteBenchRow]:
    """One round per number of streams (a short warm-up round first). `at_once`: the most
    streams in flight together (the Benchmark tab keeps places for other users' replies:
    RemoteEngine.bench_places)."""
    if not streams or min(streams) < 1 or max(streams) > 256:
        raise ValueError("streams must be between 1 and 256")
    if not 1 <= new_tokens <= 8192:
        raise ValueError("new_tokens must be between 1 and 8192")
    one_round(engine, 1, min(new_tokens, 8), prompt_words)  # connection and server warm-up
    return [one_round(engine, n, new_tokens, prompt_words, at_once) for n in streams]


def markdown_table(rows: list[RemoteBenchRow]) -> str:
    def f(value):
        return "-" if value is None else f"{value:g}"

    header = ("| streams | replies | errors | TTFT p50 (ms) | TTFT max (ms) | tok/s per stream "
              "(p50) | tok/s all streams | tokens | wall (s) | at once |")
    lines = [header, "|---" * 10 + "|"]
    for r in rows:
        lines.append(f"| {r.streams} | {r.replies} | {r.errors} | {f(r.ttft_ms_p50)} | "
                     f"{f(r.ttft_ms_max)} | {f(r.tok_s_per_stream_p50)} | {r.aggregate_tok_s:g} "
                     f"| {r.new_tokens} | {r.wall_s:g} | {r.at_once or r.streams} |")
    if any(r.at_once and r.at_once < r.streams for r in rows):
        lines.append("\nAt once: the most streams in flight together; the other places are "
                     "kept for other users' replies.")
    for r in rows:
        lines += [f"\n{r.streams} streams: {sample}" for sample in r.error_samples]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from .flags import add_backend_flags, check_backend_flags, remote_engine

    parser = argparse.ArgumentParser(prog="python -m model_utils.backends.bench",
                                     description=__doc__.split("\n\n")[0])
    add_backend_flags(parser)
    parser.add_argument("--streams", default="1,8", help="comma-separated numbers of "
                        "concurrent streams (default 1,8)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-words", type=int, default=32)
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if not args.backend:
        parser.error("--backend URL is required")
    try:
        streams = tuple(int(s) for s in args.streams.split(","))
    except ValueError:
        parser.error("--streams: expected numbers such as 1,8,32")
    args.max_batch, args.max_queue, args.log_prompts = max(streams), 0, False
    check_backend_flags(args, parser.error)
    engine = remote_engine(args)
    try:
        rows = bench_remote(engine, streams=streams, new_tokens=args.new_tokens,
                            prompt_words=args.prompt_words)
    except Exception as error:  # noqa: BLE001 - unreachable server, bad sizes: one line
        print(f"bench: {error}", file=sys.stderr)
        return 1
    finally:
        engine.close()
    status = engine.status()
    print(f"{status['model']} at {status['backend_url']}, {args.new_tokens} new tokens, "
          f"greedy\n")
    print(markdown_table(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"backend": status["backend_url"], "model": status["model"],
                       "new_tokens": args.new_tokens, "rows": [asdict(r) for r in rows]},
                      out, indent=2)
    return 0 if all(r.errors == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
