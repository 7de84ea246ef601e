"""The engine's captured decode step on a GPU, timed and profiled kernel by kernel.

    python benchmarks/step_profile.py --config benchmarks/configs/qwen2.5-7b-instruct.config.json \\
        --layers 4 --context 32768 --rows 1,8 --compiled-rows 1,0

A model of the config's shape (with --layers layers: the cost of a step is per layer; full
attention throughout, or with --keep-layer-types the config's first layer types, so that a
hybrid model's linear-attention layers are profiled too) and random bf16 weights is loaded
through the engine in each of --modes (bf16 by default), once per --compiled-rows value (1: the
one-row step torch.compile'd before capture; 32: every batch up to 32 rows, as the engine's
default; 0: the plain forward captured). For
each row count the step's graph is replayed and timed with CUDA events, then profiled: the
kernels of one replay, the costliest first. A kernel that reads or writes far more than the
weights and one token per row would shows at the top.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model_utils.engine import Engine  # noqa: E402
from model_utils.loading.loaded_model import LoadRequest
from model_utils.loading.placement import Placement  # noqa: E402


def build(config_file: Path, layers: int, folder: Path, keep_layer_types: bool = False) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    from model_utils.loading.demo_model import demo_tokenizer

    types = AutoConfig.from_pretrained(config_file).get_text_config().layer_types
    types = list(types[:layers]) if keep_layer_types and types else ["full_attention"] * layers
    config = AutoConfig.from_pretrained(config_file, num_hidden_layers=layers, layer_types=types)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    demo_tokenizer().save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    return folder


def profile_step(engine: Engine, rows: int, length: int) -> dict:
    runner = engine.serving.scheduler.runner

    def run():
        with torch.inference_mode():
            kv = runner._cache()
            kv.pad_rows(0, rows)
            runner.step_fn(kv, rows)  # captured now if it was not
            kv.pos[:rows] = length  # rows of `length` tokens (their table: the null block)
            kv.set_lengths(rows, length + 1, rows * (length + 1))
            for _ in range(3):
                runner.step_fn(kv, rows)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                runner.step_fn(kv, rows)
            end.record()
            torch.cuda.synchronize()
            step_ms = start.elapsed_time(end) / 20
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    runner.step_fn(kv, rows)
                torch.cuda.synchronize()
            kv.pad_rows(0, kv.rows)
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)
            return step_ms, table

    step_ms, table = engine.worker.call(run)
    return {"rows": rows, "step_ms": round(step_ms, 3), "kernels": table}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--length", type=int, default=4096, help="tokens each row attends to")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--compiled-rows", default="1,0")
    parser.add_argument("--keep-layer-types", action="store_true",
                        help="the config's first --layers layer types (a hybrid model's linear-"
                        "attention layers) instead of full attention throughout")
    parser.add_argument("--modes", default="bf16",
                        help="comma-separated modes, each loaded in turn (e.g. bf16,int8-wo: "
                        "where a quantized mode's step goes at 8 or 32 rows)")
    parser.add_argument("--out", default="step_profile.json")
    args = parser.parse_args(argv)
    folder = build(Path(args.config), args.layers, Path(tempfile.mkdtemp(prefix="step-")),
                   args.keep_layer_types)
    row_counts = [int(x) for x in args.rows.split(",")]
    results = []
    runs = [(mode, int(x)) for mode in args.modes.split(",") for x in args.compiled_rows.split(",")]
    for mode, compiled in runs:
        engine = Engine(max_batch=max(row_counts), compiled_rows=compiled)
        engine.registry.allow_root(str(folder))
        started = time.perf_counter()
        engine.load(LoadRequest(str(folder), mode, Placement("cuda:0"),
                                context_tokens=args.context))
        load_s = round(time.perf_counter() - started, 1)  # compiling and capturing included
        status = engine.status()
        for rows in row_counts:
            result = profile_step(engine, rows, args.length)
            step_fn = engine.serving.scheduler.runner.step_fn
            result.update(mode=mode, compiled_rows=compiled, decode_path=status["decode_path"],
                          decode_path_reason=status.get("decode_path_reason"),
                          kv_cache_gb=status.get("kv_cache_gb"), load_s=load_s,
                          chosen=getattr(step_fn, "chosen", {}).get(rows))
            print(f"{mode} compiled_rows={compiled} rows={rows}: {result['step_ms']} ms a step "
                  f"({args.layers} layers, {args.length} tokens a row)")
            print(result["kernels"], flush=True)
            results.append(result)
        engine.unload()
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
