"""Benchmark: the engine's decode path against plain from_pretrained + model.generate.

    python -m model_utils.bench --model demo --modes bf16,nf4 --batch 1,8 \\
        --prompt-tokens 128 --new-tokens 256 --out results.json

For each mode it loads the model through the engine (the path a user's load takes), measures
time to first token and decode speed for one stream and for `batch` concurrent requests (decoded
together by the engine's batch scheduler, each submitted from its own thread the way concurrent
chats arrive), unloads it, then loads the same checkpoint the way most tutorials do and times
model.generate on the same prompts in the same process. Greedy decoding on both sides, so their
tokens must agree; the concurrent streams must also equal the engine's own single streams.
--random-from-config builds a model of a published shape with random weights (speed does not
depend on the values), so real sizes can be measured without downloading anything.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from . import quality
from .decoders import input_device
from .engine import Engine, eos_ids
from .fast_path import COMPILE_MODES
from .generation import GenerationSettings, ReplyStats, decode_tokens
from .manager import LoadRequest
from .memory import GB
from .modes import get_mode, quantization_config
from .placement import Placement
from .weight_only import load_quantized

log = logging.getLogger(__name__)


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
    greedy_match: bool
    first_mismatch: list  # per compared prompt: the first token that differs, None when equal
    # The same comparison for transformers' own static KV cache (generate with
    # cache_implementation="static", uncompiled) against its default cache: how far two correct
    # implementations of greedy decoding agree in this precision.
    peer_static_first_mismatch: list
    batch_match: bool | None = None  # concurrent streams == the engine's single streams
    # Next-token distributions against the fp32 model's, teacher-forced (quality.py)
    kl_vs_fp32: float | None = None
    top1_vs_fp32: float | None = None


# -- inputs -------------------------------------------------------------------------------------
def random_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    # Token ids from the low end of the vocabulary, which every tokenizer in use defines.
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, min(vocab, 1000), (count, length), generator=g).tolist()


def build_random_model(config_file: Path, folder: Path, device: str) -> Path:
    """A checkpoint of the config's shape with random bf16 weights, plus the demo tokenizer
    with a word for every id of the shape's vocabulary.

    Random weights pick any id of the vocabulary, and the demo tokenizer knows only ~600: the
    rest would decode to no text at all, so a reply would stream nothing until its end and a
    client's time to first text would measure the wrong thing. Each id beyond the demo's gets
    a word of its own (" t1234"), so replies stream text the way a real model's do."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .demo_model import demo_model_path

    config = AutoConfig.from_pretrained(config_file)
    start = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.do_sample = False
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
    vocab = config.get_text_config(decoder=True).vocab_size
    tokenizer.add_tokens([f" t{i}" for i in range(len(tokenizer), vocab)])
    tokenizer.save_pretrained(folder)
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    log.info("built a random %s in %.1f s at %s", config_file.name, time.perf_counter() - start,
             folder)
    return folder


# -- measuring ----------------------------------------------------------------------------------
def reset_peaks() -> None:
    for i in range(torch.cuda.device_count()):
        torch.cuda.reset_peak_memory_stats(i)


def peaks_gb(reserved: bool = False) -> dict:
    if not torch.cuda.is_available():
        import psutil

        return {} if reserved else {"cpu_rss": round(psutil.Process().memory_info().rss / GB, 3)}
    peak = torch.cuda.max_memory_reserved if reserved else torch.cuda.max_memory_allocated
    return {f"cuda:{i}": round(peak(i) / GB, 3) for i in range(torch.cuda.device_count())}


def greedy(new_tokens: int) -> GenerationSettings:
    return GenerationSettings(max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              temperature=0.0, top_p=1.0, top_k=0, repetition_penalty=1.0)


def engine_decode(engine: Engine, prompt: list[int], new_tokens: int) -> tuple[list[int], ReplyStats]:
    """One greedy reply on the engine's own decode path: its batch scheduler (or, for a model
    it cannot batch, the single-stream decoder on its worker thread)."""
    loaded = engine.manager.loaded
    stats = ReplyStats()
    if loaded.batcher is not None:
        tokens = list(loaded.batcher.submit(prompt, greedy(new_tokens), eos_ids=eos_ids(loaded),
                                            stop=threading.Event(), stats=stats))
        return tokens, stats
    tokens = engine.worker.call(lambda: list(decode_tokens(
        engine.decoder_for(loaded), prompt, greedy(new_tokens), eos_ids=eos_ids(loaded),
        stats=stats)))
    return tokens, stats


def engine_concurrent(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """len(prompts) requests submitted at once through the engine, one thread each:
    aggregate tokens/s (wall time from the first submission to the last token), median TTFT,
    and every stream's tokens."""
    results = [None] * len(prompts)

    def one(i):
        results[i] = engine_decode(engine, prompts[i], new_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    return {"aggregate": sum(len(r[0]) for r in results) / elapsed,
            "ttft_ms": statistics.median(r[1].ttft_ms for r in results),
            "tokens": [r[0] for r in results],
            "batched_with": max(r[1].batched_with for r in results)}


def warm_batches(engine: Engine, batches: list[int]) -> None:
    """Compile the batched step for every row bucket up to the largest batch before timing
    (each new shape compiles once, which would otherwise land inside a timed run)."""
    loaded = engine.manager.loaded
    if loaded.batcher is not None:
        counts = range(1, max(batches) + 1)
        engine.worker.call(lambda: loaded.batcher.warm_up(counts))


def engine_streaming_tok_s(engine: Engine, new_tokens: int) -> float:
    """Decode tokens/s as a chat client sees them: through engine.chat (worker thread, queue,
    detokenization, reasoning split), from the first token to the last update received."""
    messages = [{"role": "user", "content": "Tell me a long story about the sea. " * 8}]
    start = time.perf_counter()
    final = None
    for final in engine.chat(messages, greedy(new_tokens), thinking=False):
        pass
    last = time.perf_counter()
    decode_s = last - start - final.stats.ttft_ms / 1000
    return (final.stats.new_tokens - 1) / max(decode_s, 1e-9)


def peer_generate(model, prompts: list[list[int]], new_tokens: int) -> tuple[list, float, float]:
    """Plain model.generate on a batch: (tokens, ttft_ms, per-stream decode tok/s)."""
    ids = torch.tensor(prompts, device=input_device(model))
    kwargs = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.inference_mode():
        # Warm-up (cuBLAS handles, allocator), then one token alone for the time to first token.
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kwargs)
        sync()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        sync()
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        sync()
        total = time.perf_counter() - start
    tokens = out[:, ids.shape[1]:].tolist()
    return tokens, ttft * 1000, (new_tokens - 1) / max(total - ttft, 1e-9)


def peer_static_tokens(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens of model.generate with transformers' own static KV cache, uncompiled."""
    ids = torch.tensor([prompt], device=input_device(model))
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids),
                             cache_implementation="static", disable_compile=True)
    return out[0, ids.shape[1]:].tolist()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# -- one mode -----------------------------------------------------------------------------------
def measure_engine(engine: Engine, prompts: list[list[int]], batches: list[int],
                   new_tokens: int, match_prompts: int) -> dict[int, dict]:
    engine_decode(engine, prompts[0], 8)  # first reply after load: allocator, cuBLAS
    warm_batches(engine, batches)
    runs_by_batch = {}
    for b in batches:
        if b == 1:
            runs = [engine_decode(engine, prompts[i], new_tokens) for i in range(match_prompts)]
            tok_s = statistics.median(r[1].tok_s for r in runs)
            runs_by_batch[1] = {"tokens": [r[0] for r in runs], "tok_s": tok_s,
                                "aggregate": tok_s,
                                "ttft_ms": statistics.median(r[1].ttft_ms for r in runs)}
        else:
            run = engine_concurrent(engine, prompts[:b], new_tokens)
            singles = runs_by_batch.get(1, {}).get("tokens", [])
            runs_by_batch[b] = {"aggregate": run["aggregate"], "tok_s": run["aggregate"] / b,
                                "ttft_ms": run["ttft_ms"],
                                "batch_match": all(x == y for x, y in zip(run["tokens"], singles))
                                if singles else None}
            log.info("batch %d: %.1f tok/s aggregate, at most %d replies per step", b,
                     run["aggregate"], run["batched_with"])
    return runs_by_batch


def measure_peer(model, prompts: list[list[int]], batches: list[int], new_tokens: int,
                 match_prompts: int) -> dict[int, dict]:
    runs_by_batch = {}
    for b in batches:
        if b == 1:
            runs = [peer_generate(model, [prompts[i]], new_tokens) for i in range(match_prompts)]
            tok_s = statistics.median(r[2] for r in runs)
            runs_by_batch[1] = {"tokens": [r[0][0] for r in runs], "tok_s": tok_s,
                                "aggregate": tok_s,
                                "ttft_ms": statistics.median(r[1] for r in runs),
                                "static_tokens": [peer_static_tokens(model, prompts[i],
                                                                     new_tokens)
                                                  for i in range(match_prompts)]}
        else:
            _, ttft, tok_s = peer_generate(model, prompts[:b], new_tokens)
            runs_by_batch[b] = {"ttft_ms": ttft, "tok_s": tok_s, "aggregate": tok_s * b}
    return runs_by_batch


def make_rows(status: dict, batches: list[int], mine: dict, theirs: dict, *, peak: dict,
              peak_reserved: dict, stream_tok_s: float | None,
              peer_load_s: float) -> list[BenchRow]:
    plain = theirs.get(1, {})
    mismatches = [first_mismatch(x, y) for x, y in zip(mine.get(1, {}).get("tokens", []),
                                                       plain.get("tokens", []))]
    static_mismatches = [first_mismatch(x, y) for x, y in zip(plain.get("static_tokens", []),
                                                              plain.get("tokens", []))]
    kv_gb = status.get("kv_cache_gb")
    over = None
    if torch.cuda.is_available() and kv_gb is not None:
        over = round((sum(peak.values()) / (status["footprint_gb"] + kv_gb) - 1) * 100, 1)
    rows = []
    for b in batches:
        m, t = mine[b], theirs[b]
        rows.append(BenchRow(
            mode=status["mode"], batch=b, decode_path=status["decode_path"],
            load_s=round(status["load_s"], 2), weights_gb=round(status["footprint_gb"], 3),
            peak_gb=peak, peak_reserved_gb=peak_reserved, kv_gb=kv_gb,
            over_weights_kv_pct=over, memory_stages=status.get("memory_stages", {}),
            ttft_ms=round(m["ttft_ms"], 2), tok_s=round(m["tok_s"], 2),
            aggregate_tok_s=round(m["aggregate"], 2),
            x_one_plain=round(m["aggregate"] / theirs[1]["tok_s"], 2) if 1 in theirs else None,
            stream_tok_s=round(stream_tok_s, 2) if (b == 1 and stream_tok_s) else None,
            peer_load_s=round(peer_load_s, 2), peer_ttft_ms=round(t["ttft_ms"], 2),
            peer_tok_s=round(t["tok_s"], 2), peer_aggregate_tok_s=round(t["aggregate"], 2),
            speedup=round(m["aggregate"] / max(t["aggregate"], 1e-9), 2),
            ttft_ratio=round(m["ttft_ms"] / max(t["ttft_ms"], 1e-9), 2),
            greedy_match=all(x is None for x in mismatches),
            first_mismatch=mismatches, peer_static_first_mismatch=static_mismatches,
            batch_match=m.get("batch_match"),
        ))
    return rows


def bench_mode(engine: Engine, model_name: str, mode: str, placement: Placement,
               batches: list[int], prompt_tokens: int, new_tokens: int,
               match_prompts: int, reference=None) -> list[BenchRow]:
    """Load `mode` through the engine and measure it, unload, then the peer from scratch.
    reference: (token sequences, the fp32 model's log-probabilities on them), for quality."""
    reset_peaks()
    status = engine.load(LoadRequest(model_name, mode, placement,
                                     context_tokens=max(prompt_tokens + new_tokens + 64, 1024)))
    loaded = engine.manager.loaded
    vocab = loaded.model.config.get_text_config().vocab_size
    prompts = random_prompts(max(max(batches), match_prompts), prompt_tokens, vocab)
    mine = measure_engine(engine, prompts, batches, new_tokens, match_prompts)
    stream_tok_s = engine_streaming_tok_s(engine, new_tokens) if 1 in batches else None
    peak, peak_reserved = peaks_gb(), peaks_gb(reserved=True)
    scores = engine.worker.call(lambda: quality.compare(
        reference[1], quality.next_token_logprobs(loaded.model, reference[0]))) \
        if reference else {}
    status = engine.status()  # now with the caches allocated by the first reply (CPU)
    engine.unload()

    # The peer: what the tutorials do, in the same process on the same prompts.
    mode_row = get_mode(mode)
    kwargs = {"dtype": mode_row.dtype}
    if mode_row.uses_bitsandbytes:
        kwargs["quantization_config"] = quantization_config(mode_row)
    device_map = {"": 0} if torch.cuda.is_available() else {"": "cpu"}
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    if mode_row.is_weight_only:  # no library default to compare with: the same weights
        peer = load_quantized(loaded.source.path, mode_row.weight_only_bits,
                              mode_row.group_size, device_map=device_map, **kwargs)
    else:
        peer = AutoModelForCausalLM.from_pretrained(loaded.source.path, device_map=device_map,
                                                    **kwargs)
    peer_load_s = time.perf_counter() - start
    theirs = measure_peer(peer, prompts, batches, new_tokens, match_prompts)
    del peer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    rows = make_rows(status, batches, mine, theirs, peak=peak, peak_reserved=peak_reserved,
                     stream_tok_s=stream_tok_s, peer_load_s=peer_load_s)
    for row in rows:
        row.kl_vs_fp32, row.top1_vs_fp32 = scores.get("kl_vs_fp32"), scores.get("top1_vs_fp32")
    return rows


def bench_loaded(engine: Engine, *, prompt_tokens: int = 32, new_tokens: int = 64,
                 batches: tuple[int, ...] = (1,), match_prompts: int = 1) -> list[BenchRow]:
    """The same measurement on the model that is loaded now (the UI's Benchmark panel).

    The peer is plain model.generate on the very same model object, so nothing is reloaded;
    every model call runs on the engine's worker thread, between replies.
    """
    batches = list(batches)
    with engine.manager.use() as loaded:
        status = engine.status()
        vocab = loaded.model.config.get_text_config().vocab_size
        budget = loaded.context_tokens - new_tokens
        if prompt_tokens < 1 or new_tokens < 1 or budget < prompt_tokens:
            raise ValueError(f"prompt_tokens + new_tokens must fit the context window "
                             f"({loaded.context_tokens}) and both be at least 1")
        prompts = random_prompts(max(max(batches), match_prompts), prompt_tokens, vocab)
        reset_peaks()
        mine = measure_engine(engine, prompts, batches, new_tokens, match_prompts)
        peak, peak_reserved = peaks_gb(), peaks_gb(reserved=True)
        status = engine.status()
        theirs = engine.worker.call(
            lambda: measure_peer(loaded.model, prompts, batches, new_tokens, match_prompts))
    return make_rows(status, batches, mine, theirs, peak=peak, peak_reserved=peak_reserved,
                     stream_tok_s=None, peer_load_s=status["load_s"])


# -- output -------------------------------------------------------------------------------------
COLUMNS = ["mode", "batch", "decode_path", "load_s", "weights_gb", "ttft_ms", "peer_ttft_ms",
           "tok_s", "peer_tok_s", "aggregate_tok_s", "peer_aggregate_tok_s", "speedup",
           "x_one_plain", "stream_tok_s", "greedy_match", "batch_match",
           "over_weights_kv_pct", "kl_vs_fp32", "top1_vs_fp32"]


def markdown_table(rows: list[BenchRow]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " | peak_gb |",
             "|" + "---|" * (len(COLUMNS) + 1)]
    for row in rows:
        d = asdict(row)
        peak = ", ".join(f"{k} {v}" for k, v in row.peak_gb.items())
        lines.append("| " + " | ".join(str(d[c]) for c in COLUMNS) + f" | {peak} |")
    notes = [greedy_note(row) for row in rows if row.batch == 1 and not row.greedy_match]
    return "\n".join(lines) + "".join("\n\n" + note for note in notes)


def greedy_note(row: BenchRow) -> str:
    """Why greedy tokens may differ, with this run's reference: plain generate against
    transformers' own static cache, two correct decoders on the same weights."""
    def tokens(found: list) -> str:
        return ", ".join("none" if i is None else str(i) for i in found)

    where = (f"{row.mode}: the greedy tokens first differ from plain generate's at token "
             f"{tokens(row.first_mismatch)} (one per prompt); transformers' own static cache "
             f"differs from plain generate at token {tokens(row.peer_static_first_mismatch)}. ")
    if row.mode == "fp32":  # equal on the H200 (3 prompts x 256 tokens) and in the CPU tests
        return where + "In fp32 the two agreed wherever measured: this one is worth reporting."
    return where + ("In low precision any other order of the same arithmetic can flip a near "
                    "tie between two tokens, and from there the replies part (BENCHMARKS.md, "
                    "greedy equality in bf16); in fp32 they agreed.")


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


def run(args: argparse.Namespace) -> list[BenchRow]:
    batches = [int(b) for b in args.batch.split(",")]
    engine = Engine(compile=not args.no_compile, compile_mode=args.compile_mode,
                    max_batch=args.max_batch or max(batches),
                    compiled_rows=args.compiled_rows)
    model_name = args.model
    if args.random_from_config:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        folder = Path(tempfile.mkdtemp(prefix="bench-model-"))
        build_random_model(Path(args.random_from_config), folder, device)
        model_name = str(folder)
    if model_name != "demo":
        engine.registry.allow_root(model_name)
    placement = Placement(args.placement or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    reference = quality_reference(engine, model_name, args.quality_positions)
    rows = []
    for mode in args.modes.split(","):
        rows += bench_mode(engine, model_name, mode.strip(), placement,
                           [int(b) for b in args.batch.split(",")], args.prompt_tokens,
                           args.new_tokens, args.match_prompts, reference)
        print(markdown_table(rows[-len(args.batch.split(",")):]), flush=True)
    return rows


def quality_reference(engine: Engine, model_name: str, positions: int):
    """(token sequences, fp32 log-probabilities) for quality.compare, None when positions is 0."""
    if positions <= 0:
        return None
    from transformers import AutoTokenizer

    path = engine.registry.resolve(model_name).path
    sequences = quality.sequences(AutoTokenizer.from_pretrained(path), positions)
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    return sequences, quality.fp32_reference(path, sequences, device=device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model_utils.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo", help="demo, a model folder or a cached hub id")
    parser.add_argument("--random-from-config", help="config.json of a shape to build with "
                        "random weights (on the GPU when there is one)")
    parser.add_argument("--modes", default="bf16", help="comma-separated modes, e.g. bf16,nf4")
    parser.add_argument("--batch", default="1", help="comma-separated batch sizes, e.g. 1,8")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--match-prompts", type=int, default=3,
                        help="prompts on which greedy output is compared token for token")
    parser.add_argument("--placement", help="default: cuda:0 with a GPU, else cpu")
    parser.add_argument("--max-batch", type=int, default=None,
                        help="rows of the engine's batch (default: the largest --batch)")
    parser.add_argument("--no-compile", action="store_true", help="benchmark the eager path")
    parser.add_argument("--compiled-rows", type=int, default=1,
                        help="batched steps of up to this many rows are torch.compile'd before "
                             "capture, larger ones capture the plain forward (64: compile all)")
    parser.add_argument("--compile-mode", default="default",
                        choices=COMPILE_MODES,
                        help="torch.compile mode of the fast path's decode step")
    parser.add_argument("--quality-positions", type=int, default=381,
                        help="teacher-forced positions for kl_vs_fp32 / top1_vs_fp32 (0: skip)")
    parser.add_argument("--out", default="results.json", help="JSON file to write")
    parser.add_argument("--chart", help="PNG chart (default: next to --out)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        rows = run(args)
    except (ValueError, RuntimeError) as error:
        print(f"bench: {error}", file=sys.stderr)
        return 2
    print("\n" + markdown_table(rows))
    meta = {"torch": torch.__version__, "cuda": torch.cuda.get_device_name(0)
            if torch.cuda.is_available() else None}
    import transformers

    meta["transformers"] = transformers.__version__
    out = Path(args.out)
    out.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2))
    chart = Path(args.chart) if args.chart else out.with_suffix(".png")
    save_chart(rows, chart)
    print(json.dumps([asdict(r) for r in rows]))
    print(f"wrote {out} and {chart}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
