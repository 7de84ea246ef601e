"""One benchmark per mode (the command line: load through the engine, measure, unload, load the
peer the plain way) and on the loaded model (the UI panel: nothing reloaded, and replies go
first, see gate.py)."""

from __future__ import annotations

import functools
import gc
import time

import torch

from model_utils.engine import Engine
from model_utils.layers.weight_only import load_quantized
from model_utils.loading.loaded_model import LoadRequest
from model_utils.loading.modes import get_mode, quantization_config
from model_utils.loading.placement import Placement

from . import logprobs as bench_logprobs
from . import quality
from .gate import Gate
from .inputs import random_prompts
from .measure import (
    engine_streaming_tok_s,
    first_mismatch,
    measure_engine,
    measure_peer,
    peaks_gb,
    reset_peaks,
    settle,
)
from .report import BenchRow

# What the UI panel may ask for: each figure is bounded so that a run takes seconds to a
# minute and holds at most a few MB of logprobs, whatever a request says.
LOADED_LIMITS = {"prompt_tokens": 512, "new_tokens": 128, "batch": 8, "match_prompts": 3}


def make_rows(status: dict, batches: list[int], mine: dict, theirs: dict, *, peak: dict,
              peak_reserved: dict, stream_tok_s: float | None, peer_load_s: float,
              logprobs: dict | None = None) -> list[BenchRow]:
    plain = theirs.get(1, {})
    mismatches = [first_mismatch(x, y) for x, y in zip(mine.get(1, {}).get("tokens", []),
                                                       plain.get("tokens", []))]
    static_mismatches = [first_mismatch(x, y) for x, y in zip(plain.get("static_tokens", []),
                                                              plain.get("tokens", []))]
    kv_gb = status.get("kv_cache_gb")
    over = None
    if torch.cuda.is_available() and kv_gb is not None:
        over = round((sum(peak.values()) / (status["footprint_gb"] + kv_gb) - 1) * 100, 1)
    fp32 = status["mode"] == "fp32"
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
            greedy_match=all(x is None for x in mismatches) if fp32 else None,
            first_mismatch=mismatches, peer_static_first_mismatch=static_mismatches,
            batch_match=m.get("batch_match"),
            **bench_logprobs.row_fields((logprobs or {}).get(b)),
        ))
    return rows


def load_peer(path, mode: str):
    """The checkpoint loaded the way most tutorials do."""
    from transformers import AutoModelForCausalLM

    mode_row = get_mode(mode)
    kwargs = {"dtype": mode_row.dtype}
    if mode_row.uses_bitsandbytes:
        kwargs["quantization_config"] = quantization_config(mode_row)
    device_map = {"": 0} if torch.cuda.is_available() else {"": "cpu"}
    if mode_row.is_weight_only:  # no library default to compare with: the same weights
        return load_quantized(path, mode_row.weight_only_bits, mode_row.group_size,
                              device_map=device_map, fmt=mode_row.weight_format, **kwargs)
    return AutoModelForCausalLM.from_pretrained(path, device_map=device_map, **kwargs)


def _scores_against(model, reference) -> dict:
    return quality.compare(reference[1], quality.next_token_logprobs(model, reference[0]))


def bench_mode(engine: Engine, model_name: str, mode: str, placement: Placement,
               batches: list[int], prompt_tokens: int, new_tokens: int,
               match_prompts: int, *, logprobs: bool = True, reference=None) -> list[BenchRow]:
    """Load `mode` through the engine and measure it, unload, then the peer from scratch.
    reference: (token sequences, the fp32 model's log-probabilities on them), for quality."""
    reset_peaks()
    status = engine.load(LoadRequest(model_name, mode, placement,
                                     context_tokens=max(prompt_tokens + new_tokens + 64, 1024)))
    settle(engine)  # the graphs a load leaves for idle time: steady serving is measured
    loaded = engine.manager.loaded
    vocab = loaded.model.config.get_text_config().vocab_size
    prompts = random_prompts(max(max(batches), match_prompts), prompt_tokens, vocab)
    mine = measure_engine(engine, prompts, batches, new_tokens, match_prompts)
    stream_tok_s = engine_streaming_tok_s(engine, new_tokens) if 1 in batches else None
    peak, peak_reserved = peaks_gb(), peaks_gb(reserved=True)
    scores = engine.worker.call(functools.partial(_scores_against, loaded.model, reference)) \
        if reference else {}
    status = engine.status()  # now with the caches allocated by the first reply (CPU)
    found = None
    if logprobs and engine.serving.scheduler is not None:  # untimed, after the peaks were read
        found = bench_logprobs.engine_side(engine, prompts, batches, new_tokens, match_prompts)
    path = loaded.source.path
    del loaded  # held here, it would keep the whole model and its cache on the card for the peer
    engine.unload()

    # The peer: what the tutorials do, in the same process on the same prompts.
    start = time.perf_counter()
    peer = load_peer(path, mode)
    peer_load_s = time.perf_counter() - start
    theirs = measure_peer(peer, prompts, batches, new_tokens, match_prompts)
    compared = bench_logprobs.compare(peer, found) if found else None
    del peer, found
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    rows = make_rows(status, batches, mine, theirs, peak=peak, peak_reserved=peak_reserved,
                     stream_tok_s=stream_tok_s, peer_load_s=peer_load_s, logprobs=compared)
    for row in rows:
        row.kl_vs_fp32, row.top1_vs_fp32 = scores.get("kl_vs_fp32"), scores.get("top1_vs_fp32")
    return rows


def check_loaded_sizes(*, prompt_tokens: int, new_tokens: int, batches: list[int],
                       match_prompts: int, context_tokens: int) -> None:
    limits = LOADED_LIMITS
    if not batches or not all(isinstance(b, int) and 1 <= b <= limits["batch"]
                              for b in batches):
        raise ValueError(f"concurrent requests must be between 1 and {limits['batch']}")
    if not 1 <= prompt_tokens <= limits["prompt_tokens"]:
        raise ValueError(f"prompt tokens must be between 1 and {limits['prompt_tokens']}")
    if not 1 <= new_tokens <= limits["new_tokens"]:
        raise ValueError(f"new tokens must be between 1 and {limits['new_tokens']}")
    if not 1 <= match_prompts <= limits["match_prompts"]:
        raise ValueError(f"compared prompts must be between 1 and {limits['match_prompts']}")
    if prompt_tokens + new_tokens > context_tokens:
        raise ValueError(f"prompt tokens + new tokens must fit the context window "
                         f"({context_tokens})")


def bench_loaded(engine: Engine, *, prompt_tokens: int = 32, new_tokens: int = 64,
                 batches: tuple[int, ...] = (1,), match_prompts: int = 1,
                 logprobs: bool = True, gate: Gate | None = None) -> list[BenchRow]:
    """The same measurement on the model that is loaded now (the UI's Benchmark panel), with
    sizes within LOADED_LIMITS.

    The peer is plain model.generate on the very same model object, so nothing is reloaded.
    Replies come first: every call that holds the decode worker waits for a quiet engine and
    gives way between its steps to a reply that arrives (gate.Gate)."""
    batches = sorted(set(batches))
    gate = gate or Gate(engine)

    def on_worker(fn):  # fn(should_yield) on the decode worker, behind replies
        return gate.run(lambda y: engine.worker.call(lambda: fn(y)))

    with engine.manager.use() as loaded:
        check_loaded_sizes(prompt_tokens=prompt_tokens, new_tokens=new_tokens, batches=batches,
                           match_prompts=match_prompts, context_tokens=loaded.context_tokens)
        vocab = loaded.model.config.get_text_config().vocab_size
        prompts = random_prompts(max(max(batches), match_prompts), prompt_tokens, vocab)
        reset_peaks()
        # Beside users: at most 3/4 of the places at once, so that their chats are admitted.
        at_once = gate.at_once()
        mine = measure_engine(engine, prompts, batches, new_tokens, match_prompts,
                              before=gate.wait_quiet, at_once=at_once)
        peak, peak_reserved = peaks_gb(), peaks_gb(reserved=True)
        status = engine.status()
        theirs = measure_peer(loaded.model, prompts, batches, new_tokens, match_prompts,
                              run_peer=on_worker)
        compared = None
        if logprobs and engine.serving.scheduler is not None:
            gate.wait_quiet()
            found = bench_logprobs.engine_side(engine, prompts, batches, new_tokens,
                                               match_prompts, run_worker=gate.run,
                                               at_once=at_once)
            compared = bench_logprobs.compare(loaded.model, found, run_peer=on_worker)
    return make_rows(status, batches, mine, theirs, peak=peak, peak_reserved=peak_reserved,
                     stream_tok_s=None, peer_load_s=status["load_s"], logprobs=compared)
