"""Speed at the lengths conversations have, against transformers' static cache + compile.

    python -m model_utils.bench.long_context \\
        --random-from-config benchmarks/configs/qwen2.5-7b-instruct.config.json \\
        --context-tokens 32768 --lengths 128,4096,16384,30000 --streams 1,8 --new-tokens 256 \\
        --out long.json

Through the engine (the path a reply takes: the batch scheduler, the paged KV cache, CUDA graphs
on a GPU), for each prompt length: one stream (time to first token, decode tokens/s) and N
streams of that length at once (aggregate and per stream); then the mixed case, short replies
decoding alone and the same beside one long reply (its prompt prefilled before they start, so
what is measured is decoding together); then the next turn of a conversation of each length
(the prompt so far, its reply, and a short new message: the time to its first token, with the
earlier turns found in the KV cache). The peer, after the engine's model is unloaded, or alone
with --peer-only (on the H200 its compile failed in the engine's process, so run it that way
there): the same checkpoint through from_pretrained and `generate(cache_implementation=
"static")`, which compiles its decode step (one compile per cache size: each length is run once
untimed first). Greedy, EOS held back, so every reply has its full length. Prints a table and
writes JSON.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from model_utils.engine import Engine, eos_ids
from model_utils.engine_config import EngineConfig, add_model_args
from model_utils.engine_factory import build_engine
from model_utils.loading.loaded_model import LoadRequest
from model_utils.loading.placement import Placement
from model_utils.runtime.decoders import input_device
from model_utils.runtime.reply_stats import ReplyStats

from .inputs import build_random_model, random_prompts
from .logprob_runs import greedy_settings as greedy
from .measure import settle, sync

log = logging.getLogger(__name__)


def submit(engine: Engine, prompt: list[int], new_tokens: int) -> tuple[list[int], ReplyStats]:
    serving = engine.serving
    stats = ReplyStats()
    tokens = list(serving.scheduler.submit(prompt, greedy(new_tokens),
                                           eos_ids=eos_ids(serving.loaded),
                                           stop=threading.Event(), stats=stats))
    return tokens, stats


def together(engine: Engine, prompts: list[list[int]], new_tokens: list[int],
             start_after: list[int] | None = None) -> tuple[list[ReplyStats], float]:
    """Requests submitted from a thread each; those in `start_after` go first and the others
    once these have their first token. (each one's stats, wall seconds of the later ones)."""
    stats: list[ReplyStats | None] = [None] * len(prompts)
    first = threading.Event()
    early = set(start_after or [])

    def one(i):
        serving = engine.serving
        s = ReplyStats()
        stream = serving.scheduler.submit(prompts[i], greedy(new_tokens[i]),
                                          eos_ids=eos_ids(serving.loaded),
                                          stop=threading.Event(), stats=s)
        for n, _ in enumerate(stream):
            if n == 0 and i in early:
                first.set()
        stats[i] = s

    threads = {i: threading.Thread(target=one, args=(i,)) for i in range(len(prompts))}
    for i in early:
        threads[i].start()
    if early:
        first.wait(timeout=600)
    start = time.perf_counter()
    for i, thread in threads.items():
        if i not in early:
            thread.start()
    for i, thread in threads.items():
        if i not in early:
            thread.join()
    wall = time.perf_counter() - start
    for i in early:
        threads[i].join()
    return stats, wall


def engine_sweep(engine: Engine, lengths: list[int], streams: list[int], new_tokens: int,
                 vocab: int) -> list[dict]:
    rows = []
    for length in lengths:
        # Prompts of their own for every run: a prompt seen before would be found in the cache.
        for n in streams:
            if n == 1:
                runs = [submit(engine, random_prompts(1, length, vocab, seed=10 * length + i)[0],
                               new_tokens)[1] for i in range(2)]
                best = max(runs, key=lambda s: s.tok_s)
                rows.append({"prompt_tokens": length, "streams": 1,
                             "ttft_ms": round(min(s.ttft_ms for s in runs), 1),
                             "tok_s": round(best.tok_s, 1), "aggregate_tok_s": round(best.tok_s, 1)})
            else:
                prompts = random_prompts(n, length, vocab, seed=10 * length + 5)
                stats, wall = together(engine, prompts, [new_tokens] * n)
                rows.append({"prompt_tokens": length, "streams": n,
                             "ttft_ms": round(statistics.median(s.ttft_ms for s in stats), 1),
                             "tok_s": round(statistics.median(s.tok_s for s in stats), 1),
                             "aggregate_tok_s": round(sum(s.new_tokens for s in stats) / wall, 1),
                             "batched_with": max(s.batched_with for s in stats)})
            print(f"engine: {rows[-1]}", flush=True)
    return rows


def mixed_case(engine: Engine, short: int, count: int, long: int, new_tokens: int,
               vocab: int) -> dict:
    """`count` short replies alone, then beside one reply of a `long` prompt."""
    prompts = random_prompts(count, short, vocab, seed=7)
    alone, _ = together(engine, prompts, [new_tokens] * count)
    long_prompt = random_prompts(1, long, vocab, seed=8)[0]
    # The long reply runs past the short ones' end, so they decode beside it throughout.
    beside, _ = together(engine, [long_prompt] + prompts, [3 * new_tokens] + [new_tokens] * count,
                         start_after=[0])
    solo = statistics.median(s.tok_s for s in alone)
    mixed = statistics.median(s.tok_s for s in beside[1:])
    return {"short_prompt_tokens": short, "short_streams": count, "long_prompt_tokens": long,
            "short_tok_s_alone": round(solo, 1), "short_tok_s_beside_long": round(mixed, 1),
            "ratio": round(mixed / solo, 3), "long_tok_s": round(beside[0].tok_s, 1)}


def capacity_case(engine: Engine, short_count: int, long_count: int, long: int,
                  new_tokens: int, vocab: int) -> dict:
    """`short_count` 128-token chats and `long_count` prompts of `long` tokens submitted at
    once: whether they all decode together in the cache's blocks (preemptions, the most blocks
    in use at a time, each reply's full length)."""
    scheduler = engine.serving.scheduler
    prompts = random_prompts(short_count, 128, vocab, seed=11) + \
        random_prompts(long_count, long, vocab, seed=12)
    before = scheduler.kv_blocks() or {}
    peak = {"used": 0, "rows": 0}
    finished = threading.Event()

    def watch():  # the scheduler's counters, read while the replies decode
        while not finished.wait(0.02):
            peak["used"] = max(peak["used"], (scheduler.kv_blocks() or {}).get("used", 0))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        stats, wall = together(engine, prompts, [new_tokens] * len(prompts))
    finally:
        finished.set()
        watcher.join()
    after = scheduler.kv_blocks() or {}
    return {"short_streams": short_count, "long_streams": long_count, "long_prompt_tokens": long,
            "replies_whole": sum(s.new_tokens == new_tokens for s in stats),
            "replies": len(prompts),
            "preemptions": after.get("preemptions", 0) - before.get("preemptions", 0),
            "peak_blocks_used": peak["used"], "blocks_total": after.get("total"),
            "block_tokens": after.get("block_tokens"), "wall_s": round(wall, 2),
            "aggregate_tok_s": round(len(prompts) * new_tokens / wall, 1)}


def next_turns(engine: Engine, lengths: list[int], vocab: int, new_tokens: int) -> list[dict]:
    """The next turn of a conversation of each length: TTFT with its start cached."""
    rows = []
    for length in lengths:
        prompt = random_prompts(1, length, vocab, seed=10 * length + 7)[0]
        reply, first = submit(engine, prompt, new_tokens)
        follow = prompt + reply + random_prompts(1, 40, vocab, seed=3)[0]
        _, again = submit(engine, follow, 16)
        rows.append({"prompt_tokens": length, "first_turn_ttft_ms": round(first.ttft_ms, 1),
                     "next_turn_tokens": len(follow), "cached_tokens": again.cached_tokens,
                     "next_turn_ttft_ms": round(again.ttft_ms, 1)})
        print(f"next turn: {rows[-1]}", flush=True)
    return rows


def peer_static(path: str, mode: str, lengths: list[int], new_tokens: int,
                vocab: int) -> list[dict]:
    """transformers' static cache + its automatic compile, one stream per length."""
    from .per_mode import load_peer

    model = load_peer(path, mode)
    rows = []
    for length in lengths:
        ids = torch.tensor(random_prompts(1, length, vocab, seed=10 * length)[:1],
                           device=input_device(model))
        try:
            static_generate(model, ids, new_tokens)  # compiles for this cache size
            start = time.perf_counter()
            static_generate(model, ids, 1)
            ttft = time.perf_counter() - start
            start = time.perf_counter()
            static_generate(model, ids, new_tokens)
            total = time.perf_counter() - start
        except Exception as error:  # noqa: BLE001 - e.g. out of memory at the longest
            log.exception("peer at %d prompt tokens", length)
            rows.append({"prompt_tokens": length,
                         "error": f"{type(error).__name__}: {error}"[:300]})
            continue
        rows.append({"prompt_tokens": length, "ttft_ms": round(ttft * 1000, 1),
                     "tok_s": round((new_tokens - 1) / max(total - ttft, 1e-9), 1)})
        print(f"peer: {rows[-1]}", flush=True)
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def vocab_of(folder: str) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder).get_text_config().vocab_size


def static_generate(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                             cache_implementation="static")
    sync()
    return out


def markdown(result: dict) -> str:
    peer = {r["prompt_tokens"]: r for r in result["peer"]}
    if "engine" not in result:  # --peer-only
        return "\n".join(["| prompt tokens | peer TTFT ms | peer tok/s |", "|---|---|---|"] + [
            f"| {r['prompt_tokens']} | {r.get('ttft_ms', '-')} | {r.get('tok_s', r.get('error'))} |"
            for r in result["peer"]])
    lines = ["| prompt tokens | streams | TTFT ms | tok/s per stream | aggregate tok/s | "
             "peer tok/s (static cache + compile) | engine / peer |", "|---|---|---|---|---|---|---|"]
    for r in result["engine"]:
        p = peer.get(r["prompt_tokens"], {}) if r["streams"] == 1 else {}
        ratio = f"{r['tok_s'] / p['tok_s']:.2f}x" if p.get("tok_s") else "-"
        lines.append(f"| {r['prompt_tokens']} | {r['streams']} | {r['ttft_ms']} | {r['tok_s']} | "
                     f"{r['aggregate_tok_s']} | {p.get('tok_s', '-')} | {ratio} |")
    if result.get("mixed"):
        m = result["mixed"]
        lines += ["", f"{m['short_streams']} replies of {m['short_prompt_tokens']} prompt tokens: "
                  f"{m['short_tok_s_alone']} tok/s each alone, {m['short_tok_s_beside_long']} "
                  f"beside one of {m['long_prompt_tokens']} ({m['ratio']:.2f}x); the long one "
                  f"{m['long_tok_s']} tok/s"]
    if result.get("capacity"):
        c = result["capacity"]
        lines += ["", f"{c['short_streams']} chats of 128 prompt tokens and {c['long_streams']} of "
                  f"{c['long_prompt_tokens']} at once: {c['replies_whole']} of {c['replies']} "
                  f"replies whole, {c['preemptions']} preemptions, at most "
                  f"{c['peak_blocks_used']} of {c['blocks_total']} blocks of "
                  f"{c['block_tokens']} tokens in use, {c['aggregate_tok_s']} tok/s in all"]
    if result.get("next_turns"):
        lines += ["", "| conversation tokens | first turn TTFT ms | next turn tokens | cached | "
                  "next turn TTFT ms |", "|---|---|---|---|---|"]
        lines += [f"| {t['prompt_tokens']} | {t['first_turn_ttft_ms']} | {t['next_turn_tokens']} "
                  f"| {t['cached_tokens']} | {t['next_turn_ttft_ms']} |"
                  for t in result["next_turns"]]
    return "\n".join(lines)


def run(args) -> dict:
    lengths = [int(x) for x in args.lengths.split(",")]
    streams = [int(x) for x in args.streams.split(",")]
    model_name = args.model
    if args.random_from_config:
        folder = Path(tempfile.mkdtemp(prefix="long-context-"))
        build_random_model(Path(args.random_from_config), folder,
                           "cuda" if torch.cuda.is_available() else "cpu")
        model_name = str(folder)
    if args.peer_only:
        return {"peer": peer_static(model_name, args.mode, lengths, args.new_tokens,
                                    vocab_of(model_name))}
    mixed_count = args.mixed_short
    capacity = [int(x) for x in args.capacity.split(",")] if args.capacity else []
    rows = max(streams + [mixed_count + 1] + ([capacity[0] + capacity[1]] if capacity else []))
    engine = build_engine(EngineConfig.from_args(args, max_batch=rows))
    if model_name != "demo":
        engine.registry.allow_root(model_name)
    placement = Placement(args.placement or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    if max(lengths) + args.new_tokens * 3 > args.context_tokens:
        raise ValueError(f"--context-tokens {args.context_tokens} is too short for "
                         f"{max(lengths)} prompt tokens and {args.new_tokens * 3} new")
    status = engine.load(LoadRequest(model_name, args.mode, placement,
                                     context_tokens=args.context_tokens))
    settle(engine)  # the graphs a load leaves for idle time: steady serving is measured
    loaded = engine.manager.loaded
    path = str(loaded.source.path)
    vocab = loaded.model.config.get_text_config().vocab_size
    # Untimed: every row bucket's step and a first reply of each kind.
    engine.worker.call(functools.partial(engine.serving.scheduler.runner.warm_up,
                                         range(1, engine.max_batch + 1)))
    del loaded  # a reference held here would keep the model and its cache past unload
    submit(engine, random_prompts(1, 64, vocab)[0], 16)
    together(engine, random_prompts(max(streams), 64, vocab), [16] * max(streams))
    result = {"engine": engine_sweep(engine, lengths, streams, args.new_tokens, vocab)}
    if args.mixed_long:
        result["mixed"] = mixed_case(engine, 128, mixed_count, args.mixed_long, args.new_tokens,
                                     vocab)
        print(f"mixed: {result['mixed']}", flush=True)
    if capacity:
        result["capacity"] = capacity_case(engine, *capacity, args.new_tokens, vocab)
        print(f"capacity: {result['capacity']}", flush=True)
    result["next_turns"] = next_turns(engine, lengths, vocab, 32)
    status = engine.status()
    result["status"] = {k: status.get(k) for k in ("mode", "decode_path", "context_tokens",
                                                   "kv_cache_gb", "kv_blocks", "footprint_gb")}
    engine.unload()
    result["peer"] = [] if args.no_peer else peer_static(path, args.mode, lengths,
                                                         args.new_tokens, vocab)
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m model_utils.bench.long_context",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, placement_default="cuda:0 with a GPU, else cpu",
                   context_default=32768)
    parser.add_argument("--random-from-config", help="config.json of a shape to build with "
                        "random weights (on the GPU when there is one)")
    parser.add_argument("--lengths", default="128,4096,16384,30000",
                        help="comma-separated prompt lengths")
    parser.add_argument("--streams", default="1,8", help="comma-separated stream counts")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--mixed-long", type=int, default=16384,
                        help="prompt tokens of the long reply in the mixed case (0: skip it)")
    parser.add_argument("--mixed-short", type=int, default=7,
                        help="short replies in the mixed case")
    parser.add_argument("--capacity", default="",
                        help="SHORT,LONG,TOKENS: SHORT 128-token chats and LONG prompts of "
                             "TOKENS tokens at once, e.g. 32,2,32000 (default: skip)")
    parser.add_argument("--no-peer", action="store_true", help="skip the static-cache peer")
    parser.add_argument("--peer-only", action="store_true",
                        help="only the static-cache peer, in a process of its own")
    EngineConfig.add_cli_args(parser, only=("compile", "compiled_rows", "compile_mode"))
    parser.add_argument("--out", default="long_context.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    start = time.perf_counter()
    try:
        result = run(args)
    except (ValueError, RuntimeError) as error:
        print(f"long_context: {error}", file=sys.stderr)
        return 2
    import transformers

    result["meta"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                      "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                      "date": time.strftime("%Y-%m-%d"), "seconds": round(time.perf_counter() - start)}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("\n" + markdown(result))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
