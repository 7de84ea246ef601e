"""Weight-only quantization candidates side by side, through the engine's decode path.

    python benchmarks/quant_candidates.py --config benchmarks/configs/qwen2.5-7b-instruct.config.json \\
        --out "$OUT"

One process, one GPU, a checkpoint of the config's shape with random bf16 weights (speed does
not depend on the values). Each candidate is loaded through the engine (the path a user's load
takes: compiled decode steps, CUDA graphs for every batch size and for the prefills), then:
time to first token and decode tokens/s for one stream (128-token prompt, 256 new tokens,
greedy), the aggregate for 8 and for 32 concurrent streams (--streams), the weights' memory and the peak while
loading, mean KL and top-1 agreement of next-token distributions against the fp32 model, and a
torch.profiler summary of one decode step (per kernel). Candidates:

- bf16, int4-wo, int8-wo, nf4, ...: the app's own modes (model_utils/loading/modes.py);
- torchao-int4 / torchao-int8: torchao 0.18's Int4WeightOnlyConfig (tinygemm,
  int4_packing_format="tile_packed_to_4d", group 128) / Int8WeightOnlyConfig, applied to the
  engine's bf16 model before it compiles;
- gemlite-int8: gemlite's Triton kernels (A16W8_INT8), swapped in the same way (the app's int4-wo
  runs MSLK's CUTLASS kernel with its own GEMV for one row where mslk-cuda loads, else gemlite's
  int4 kernels where gemlite is installed; int4-wo-mslk, int4-wo-gemlite and int4-wo-tinygemm:
  the app's int4 layers through that kernel alone);
- int8-wo-aten: the app's int8-wo with PyTorch's own torch._weight_int8pack_mm kernel;
  int8-wo-hybrid: the same for two rows or more (batches, prefills), the compiled one-row step
  as in int8-wo; int4-wo-head8: int4-wo with lm_head in int8 weight-only (gemlite) as well;
  int4-wo-g64: the app's int4 layers in groups of 64 instead of 128; int4-wo-dequant-prompts:
  int4-wo with 256 rows or more (prompts) multiplied by each weight dequantized to bf16 and
  cuBLAS instead of gemlite's GEMM; int8-wo-rows: int8-wo's copy in the tensor cores'
  fragment order, every row count through the app's int8_rows kernel over it;
  fp8-wo-below-8: the app's fp8 with steps of fewer than 8 rows multiplied weight-only;
  gemlite-fp8 / gemlite-fp8-dynamic: gemlite's A16W8_FP8 (weight-only) / A8W8_fp8_dynamic on
  the app's fp8 numbers.
A candidate whose package is missing, or that fails, is recorded with the reason, and the run
goes on. Candidates that would not finish within --budget-s are skipped (reported). JSON and
markdown are written after every candidate, so a run cut short still leaves its results.
On a machine without a GPU the same script runs eagerly (use a tiny config) to check it works.
Packages beyond the app's: torchao 0.18.0 and gemlite 0.6.0.post2 (pure Python over Triton) for
their candidates, bitsandbytes for nf4; the app's own modes need none of them.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quant_report import markdown  # beside this script
from quant_swaps import (  # beside this script
    LIBRARY_INDUCTOR_OPTIONS,
    SWAPS,
    missing,
    save_gemlite_configs,
)

from model_utils.bench import quality
from model_utils.bench.inputs import build_random_model, random_prompts
from model_utils.bench.measure import (
    engine_concurrent,
    engine_decode,
    reset_peaks,
    settle,
    sync,
)
from model_utils.bench.run import quality_reference
from model_utils.engine import Engine
from model_utils.engine_config import EngineConfig
from model_utils.layers.decode_fusions import fuse_for_decoding
from model_utils.loading.loaded_model import LoadRequest
from model_utils.loading.placement import Placement
from model_utils.memory import GB

log = logging.getLogger("quant_candidates")
DEFAULT = ("bf16,fp8,int4-wo-tinygemm,gemlite-fp8,fp8-wo-below-8,int4-wo,gemlite-fp8-dynamic,"
           "int8-wo,gemlite-int8,int8-wo-hybrid,int4-wo-head8,int8-wo-aten,torchao-int4,"
           "torchao-int8")
CUDA = torch.cuda.is_available()


# -- measuring one candidate ------------------------------------------------------------------------
class LoadLog(logging.Handler):
    """What the engine said while getting a candidate ready (which forward each graph captured,
    what failed): kept with its results, since a GPU run is seldom repeated."""

    NAMES = ("model_utils.runtime.cuda_graphs", "model_utils.runtime.prefill", "model_utils.engine",
             "model_utils.layers.weight_only", "model_utils.runtime.scheduler",
             "model_utils.runtime.runner")

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        if "reply:" not in record.getMessage():
            self.lines.append(f"{record.levelname} {record.getMessage()[:300]}")

    def __enter__(self):
        for name in self.NAMES:
            logging.getLogger(name).addHandler(self)
            logging.getLogger(name).setLevel(logging.INFO)
        return self

    def __exit__(self, *exc):
        for name in self.NAMES:
            logging.getLogger(name).removeHandler(self)


def profile_step(engine: Engine, steps: int = 3) -> dict:
    """torch.profiler over `steps` one-row decode steps as served (the captured graph on a GPU):
    per kernel, its time per step; and the step's wall time."""
    from torch.profiler import ProfilerActivity, profile

    runner = engine.serving.scheduler.runner

    @torch.inference_mode()  # as the scheduler's own steps: the cache is an inference tensor
    def run():
        runner.blocks()  # the cache, made at first use; every row points at the null block
        kv = runner.kv
        kv.pad_rows(0, 1)
        kv.set_lengths(1, 1, 1)
        for _ in range(3):
            runner.step_fn(kv, 1)
        sync()
        start = time.perf_counter()
        for _ in range(10):
            runner.step_fn(kv, 1)
        sync()
        wall_ms = (time.perf_counter() - start) / 10 * 1000
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                runner.step_fn(kv, 1)
            sync()
        kv.pad_rows(0, kv.rows)
        return wall_ms, prof

    wall_ms, prof = engine.worker.call(run)
    rows = _kernel_rows(prof, steps)
    where = "as served: a graph replay on a GPU"
    compiled = getattr(runner.step_fn, "compiled", None)
    if CUDA and len(rows) < 5 and compiled is not None:
        # The profiler saw no kernels inside the graph replays: the same compiled forward,
        # uncaptured, shows the same kernels (with launch gaps between them).
        @torch.inference_mode()
        def uncaptured():
            kv = runner.kv
            kv.pad_rows(0, 1)
            inputs = kv.decode_args(1)
            kv.prepare_decode(1)
            compiled(**inputs)
            sync()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as again:
                for _ in range(steps):
                    kv.prepare_decode(1)
                    compiled(**inputs)
                sync()
            kv.pad_rows(0, kv.rows)
            return again

        rows = _kernel_rows(engine.worker.call(uncaptured), steps)
        where = "the compiled forward, uncaptured"
    return {"step_wall_ms": round(wall_ms, 3), "profiled": where,
            "kernel_us_per_step": round(sum(r["us_per_step"] for r in rows), 1),
            "kernels": rows[:40]}


def _kernel_rows(prof, steps: int) -> list[dict]:
    """Per kernel (per op on a CPU): calls and device time per step, largest first."""
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(event, "self_cuda_time_total", 0)
        us = device_us if CUDA else event.self_cpu_time_total
        if us > 0 and (not CUDA or event.device_type.name == "CUDA"):
            rows.append({"kernel": event.key[:160], "calls_per_step": event.count / steps,
                         "us_per_step": round(us / steps, 2)})
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows


def measure(engine: Engine, folder: str, candidate: str, args, prompts, reference) -> dict:
    swap, _, _, mode = SWAPS.get(candidate, (None, None, None, candidate))
    placement = Placement("cuda:0" if CUDA else "cpu")
    seen: dict = {}
    prepare = previous = engine.manager.on_loaded  # the engine's: prepares and keeps serving

    def on_loaded(loaded, progress):  # between the weights' load and the compile
        if CUDA:
            seen["load_peak_gb"] = round(torch.cuda.max_memory_allocated() / GB, 3)
        if swap is not None:
            fuse_for_decoding(loaded.model)  # on the bf16 weights, as the app's own modes do (no-op)
            swap(loaded.model)
            if mode == "bf16" and not hasattr(loaded.model, "inductor_options"):
                # another library's layers: the inductor settings it advises
                loaded.model.inductor_options = LIBRARY_INDUCTOR_OPTIONS
        if CUDA:
            torch.cuda.synchronize()
            seen["weights_gb"] = round(torch.cuda.memory_allocated() / GB, 3)
        prepare(loaded, progress)

    engine.manager.on_loaded = on_loaded
    reset_peaks()
    start = time.perf_counter()
    try:
        with LoadLog() as load_log:
            status = engine.load(LoadRequest(folder, mode, placement, context_tokens=max(
                1024, args.long_prompt_tokens + 64)))
    finally:
        engine.manager.on_loaded = previous
    seen["load_log"] = load_log.lines[:60]
    result = {"candidate": candidate, "mode": mode, "decode_path": status["decode_path"],
              "decode_path_reason": status["decode_path_reason"],
              "load_and_compile_s": round(time.perf_counter() - start, 1),
              "footprint_gb": status["footprint_gb"], **seen}
    # which kernel each quantized layer runs (a forced one that failed for a shape says so)
    result["weight_only"] = getattr(engine.manager.loaded.model, "weight_only", None)
    settle(engine)  # the graphs the load left for idle time, before anything is timed
    if swap is not None and mode == "bf16":
        result["footprint_gb"] = None  # the table's count is the bf16 one; see weights_gb
    # Each timed prompt is new to the engine: a prompt longer than the padded prefill's
    # (--long-prompt-tokens beyond 1024) sent before would find its blocks in the KV cache.
    engine_decode(engine, prompts["warm"], 8)  # first reply after the load
    singles = [engine_decode(engine, prompt, args.new_tokens) for prompt in prompts["singles"]]
    result["tok_s_1"] = round(statistics.median(s.tok_s for _, s in singles), 1)
    result["ttft_ms_1"] = round(statistics.median(s.ttft_ms for _, s in singles), 2)
    result["cached_tokens_1"] = max(s.cached_tokens for _, s in singles)
    if prompts["long"]:
        engine_decode(engine, prompts["long"][0], 1)  # its prefill graph's first replay
        longs = [engine_decode(engine, prompt, 1)[1] for prompt in prompts["long"][1:]]
        result["ttft_ms_long"] = round(statistics.median(s.ttft_ms for s in longs), 2)
    for streams in args.streams:
        # fresh prompts for each count: the first `streams` of a list no count has sent
        fresh = prompts["streams"][sum(c for c in args.streams if c < streams):][:streams]
        many = engine_concurrent(engine, fresh, args.new_tokens)
        result[f"aggregate_tok_s_{streams}"] = round(many["aggregate"], 1)
        result[f"ttft_ms_p50_{streams}"] = round(many["ttft_ms"], 2)
        result[f"batched_with_{streams}"] = many["batched_with"]
    if reference is not None:
        model = engine.manager.loaded.model
        result.update(engine.worker.call(lambda: quality.compare(
            reference[1], quality.next_token_logprobs(model, reference[0]))))
    result["profile"] = profile_step(engine) if engine.serving.scheduler else None
    if CUDA:
        result["peak_gb"] = round(torch.cuda.max_memory_allocated() / GB, 3)
    engine.unload()
    return result


def keep_tuning_on_timeout(path: Path) -> None:
    """On SIGTERM (the `timeout` a GPU call runs under), write what gemlite tuned so far
    before exiting: its autotune of a shape takes tens of seconds, and a run cut while a
    candidate captures its row counts would otherwise lose all of it."""
    def on_term(signum, frame):
        if "gemlite.core" in sys.modules:
            save_gemlite_configs(path)
            print(f"stopped: gemlite's tuned configs written to {path}", flush=True)
        # The results are written after every candidate; an orderly exit would wait on the
        # engine's worker thread, mid-step.
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="config.json of the shape to build")
    parser.add_argument("--candidates", default=DEFAULT)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--streams", default="8,32",
                        help="concurrent stream counts, each measured on its own")
    parser.add_argument("--long-prompt-tokens", type=int, default=1024,
                        help="a longer prompt's time to first token, its prefill (0: skip)")
    parser.add_argument("--quality-positions", type=int, default=254)
    parser.add_argument("--budget-s", type=float, default=430,
                        help="start no candidate after this many seconds minus one "
                             "candidate's expected time")
    parser.add_argument("--out", required=True, help="folder for quant_candidates.json / .md")
    EngineConfig.add_cli_args(parser, only=("compiled_rows",))  # for every candidate alike
    args = parser.parse_args(argv)
    try:
        args.streams = sorted({int(n) for n in args.streams.split(",") if int(n) > 1})
    except ValueError:
        parser.error(f"--streams {args.streams!r}: whole numbers separated by commas")
    logging.basicConfig(level=logging.WARNING)
    start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import transformers

    meta = {"gpu": torch.cuda.get_device_name(0) if CUDA else platform.processor() or "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__,
            "config": Path(args.config).name, "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens, "compiled_rows": args.compiled_rows}
    for package in ("torchao", "gemlite", "triton", "bitsandbytes"):
        try:
            meta[package] = __import__(package).__version__
        except Exception:  # noqa: BLE001 - not installed
            meta[package] = None
    keep_tuning_on_timeout(out / "gemlite-configs.json")
    folder = Path(tempfile.mkdtemp(prefix="quant-candidates-"))
    build_random_model(Path(args.config), folder, "cuda" if CUDA else "cpu")
    engine = Engine(EngineConfig.from_args(args, max_batch=max(args.streams, default=1),
                                           max_queue=64))
    engine.registry.allow_root(str(folder))
    vocab = json.loads((folder / "config.json").read_text()).get("vocab_size", 1000)
    short = random_prompts(3 + sum(args.streams), args.prompt_tokens, vocab)
    prompts = {"warm": short[0], "singles": short[1:3], "streams": short[3:],
               "long": random_prompts(3, args.long_prompt_tokens, vocab, seed=1)
               if args.long_prompt_tokens else []}
    reference = quality_reference(engine, str(folder), args.quality_positions)
    meta["setup_s"] = round(time.perf_counter() - start, 1)
    results: list[dict] = []
    longest = 0.0
    for candidate in [c.strip() for c in args.candidates.split(",") if c.strip()]:
        elapsed = time.perf_counter() - start
        expected = max(longest, 60.0 if CUDA else 0.0)
        if reason := missing(candidate):
            results.append({"candidate": candidate, "skipped": reason})
        elif elapsed + expected > args.budget_s:
            results.append({"candidate": candidate,
                            "skipped": f"time: {elapsed:.0f} s gone, ~{expected:.0f} s each"})
        else:
            begun = time.perf_counter()
            try:
                results.append(measure(engine, str(folder), candidate, args, prompts, reference))
                if "gemlite.core" in sys.modules:  # what it tuned (int8-wo too), kept as it goes
                    save_gemlite_configs(out / "gemlite-configs.json")
            except Exception as error:  # noqa: BLE001 - recorded; the next candidate runs
                log.exception("candidate %s failed", candidate)
                results.append({"candidate": candidate,
                                "error": f"{type(error).__name__}: {str(error)[:300]}"})
                if engine.manager.loaded is not None:
                    engine.unload()
            longest = max(longest, time.perf_counter() - begun)
            gc.collect()
        print(json.dumps({k: v for k, v in results[-1].items()
                          if k not in ("profile", "load_log")}), flush=True)
        meta["elapsed_s"] = round(time.perf_counter() - start, 1)
        (out / "quant_candidates.json").write_text(json.dumps({"meta": meta, "results": results},
                                                              indent=2))
        (out / "quant_candidates.md").write_text(markdown(results, meta, args.streams))
    print(markdown(results, meta, args.streams))
    return 0


if __name__ == "__main__":
    sys.exit(main())
