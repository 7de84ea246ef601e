"""gemlite's kernels for decode batches (its GEMVs for 1-2 rows, int4's for one; its split-K GEMM
up to 63: the app's choice, gemlite_weights.kernel_for_rows),
tuned among wider grids of configs than its own "fast" lists (grid()), shape by shape, against
bf16's cuBLAS on the same shape and rows; with --held-only (and at 64+ rows), gemlite's own
tuning only, timed: the configs to ship for a model's shapes, so that its first load does not
tune them.

Why: at 32 rows int8-wo's linear layers read their int8 weights at 1.42 TB/s where bf16's
cuBLAS reads bf16 at 2.58 (H100, BENCHMARKS.md, "Where int8-wo's step goes"), which is the
8-bit modes' 32-stream gap. gemlite tunes a shape and row bucket among about twenty configs, so
a better one may exist. Its own "max" list holds 7 500 (each a Triton compile), too many for a
GPU call; grid() is a middle way.

Per linear shape of the model config (the app's fused q/k/v and gate/up, o, down) and per row
count: bf16 F.linear, gemlite with the config it holds now (shipped, or tuned by its fast list
here), then gemlite tuned among GRID. Each is timed as CUDA-graph replays (as the engine runs
them), cycling through copies of the weight that together overflow the L2 cache. Writes
OUT/gemlite_search.json and .md as it goes, and OUT/gemlite-configs.json: gemlite's
tuned configs in its own format, the faster of the two for each shape and bucket, to ship as
model_utils/layers/gemlite_configs/<gpu>.json.

    python benchmarks/gemlite_search.py --config benchmarks/configs/qwen2.5-7b-instruct.config.json \
        --rows 32,16 --weights int8 --out "$OUT"     # on the GPU host, gemlite installed
    python benchmarks/gemlite_search.py --config benchmarks/configs/qwen3-14b.config.json \
        --rows 1,2,4,8,16,32,64,512 --weights int4 --held-only --out "$OUT"
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def grid(matmul_type: str, rows: int) -> list | None:
    """The configs to search for gemlite's kernel at `rows` rows, None for a kernel not searched
    (its GEMM from 64 rows).

    Split-K GEMM (3-63 rows, int4 from 2): tiles as high as the bucket's rows (16 or 32),
    64-256 wide and deep, split-K 1-8, 4 or 8 warps, 4 or 5 stages (gemlite's pruner lowers the
    stages where shared memory is short): 144, about as many Triton compiles.
    int4's GEMV (one row, "reversed split-K"): 128-1024 columns and 8-64 rows a program, 1-8
    warps (8 to 128 weights a thread), 1 or 2 stages, either load order: 172 (its own "max"
    list stops at 512 columns and 4 warps, one load order).
    The 8-bit GEMV (1-2 rows): 4-32 columns, 256-1024 rows deep, 4 or 8 warps, 1 or 2 stages:
    48; no split-K (its kernel would add the parts atomically in bf16, as gemlite's own lists
    never do)."""
    import triton

    if matmul_type == "GEMV_SPLITK":
        return [triton.Config({"BLOCK_SIZE_M": 1, "BLOCK_SIZE_N": n, "BLOCK_SIZE_K": k,
                               "GROUP_SIZE_M": 8, "SPLIT_K": split, "A_load_order": 0,
                               "dot_prod_mode": 0}, num_warps=warps, num_stages=stages)
                for n in (4, 8, 16, 32) for k in (256, 512, 1024) for split in (1,)
                for warps in (4, 8) for stages in (1, 2)]
    if matmul_type == "GEMV_REVSPLITK":
        return [triton.Config({"BLOCK_SIZE_M": 1, "BLOCK_SIZE_N": n, "BLOCK_SIZE_K": k,
                               "A_load_order": order, "dot_prod_mode": 0},
                              num_warps=warps, num_stages=stages)
                for n in (128, 256, 512, 1024) for k in (8, 16, 32, 64)
                for warps in (1, 2, 4, 8) if 8 <= n * k // (32 * warps) <= 128
                for stages in (1, 2) for order in (0, 1)]
    if matmul_type != "GEMM_SPLITK":
        return None
    high = 32 if rows > 16 else 16
    return [triton.Config({"BLOCK_SIZE_M": high, "BLOCK_SIZE_N": n, "BLOCK_SIZE_K": k,
                           "SPLIT_K": split, "GROUP_SIZE_M": 8, "A_load_order": 0},
                          num_warps=warps, num_stages=stages)
            for n in (64, 128, 256) for k in (64, 128, 256) for split in (1, 2, 4, 8)
            for warps in (4, 8) for stages in (4, 5)]


def linear_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(out features, in features) of each linear layer a decode step runs, as the app fuses
    them (layers/fused_qkv.py, fused_mlp.py)."""
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    return {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o": (hidden, heads * head_dim),
            "gate_up": (2 * inner, hidden), "down": (hidden, inner)}


# Bytes of weights a timing cycles through: the same small matrix replayed back to back stays
# in the L2 cache (50 MB on an H100), where it reads faster than a decode step's weights do.
ROTATE_BYTES = 512 * 1024**2


def copies_for(weight_bytes: int) -> int:
    """How many copies of a weight to cycle through so that no replay finds it in L2."""
    return max(2, -(-ROTATE_BYTES // weight_bytes))


def replay_us(fns: list, reps: int = 50, rounds: int = 5) -> float:
    """Microseconds a call takes, replayed from a CUDA graph of `reps` calls cycling through
    fns (one per copy of the weight: see ROTATE_BYTES), the best of `rounds`: no launch or
    Python overhead, as in the engine's captured step."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fns[i % len(fns)]()
    best = float("inf")
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / reps)
    return best


def tuned_key(layer, rows: int) -> str:
    from model_utils.layers import gemlite_weights

    _, bucket, shape = gemlite_weights.config_signature(layer, rows)
    return str((bucket, *shape))


def config_in_use(layer, rows: int) -> dict | None:
    """The config gemlite runs for `layer` at `rows` rows: the one its autotuner chose in this
    process, else the one its table holds (as GemLiteLinear.cache_config merges them)."""
    import gemlite.core as core

    from model_utils.layers import gemlite_weights

    matmul_type, _, _ = gemlite_weights.config_signature(layer, rows)
    key = tuned_key(layer, rows)
    chosen = core.cache_kernel_config(core.GEMLITE_TRITON_MAPPING[matmul_type].kernel[0], 6)
    return chosen.get(key) or core.GEMLITE_TRITON_CONFIG_CACHE.get(matmul_type, {}).get(key)


def search(layers: list, x2, rows: int):
    """gemlite's product for the layers (copies of one shape) at x2's rows: (µs with the
    config it holds, that config, µs tuned among GRID, that config). Leaves the faster of the
    two to be written."""
    import gemlite.core as core

    from model_utils.layers import gemlite_checks, gemlite_weights

    runs = [functools.partial(gemlite_weights.product, layer, x2) for layer in layers]
    layer = layers[0]  # gemlite keys its configs by shape: one copy stands for all
    held_us = replay_us(runs)  # tunes among gemlite's own list first if it holds no config
    held = config_in_use(layer, rows)
    matmul_type, _, _ = gemlite_weights.config_signature(layer, rows)
    configs = grid(matmul_type, rows)
    if configs is None:
        return held_us, held, held_us, held
    autotuner = core.GEMLITE_TRITON_MAPPING[matmul_type].kernel[0]  # the INT kernel's
    own_configs = autotuner.configs
    gemlite_checks.forget_tuned(layer, rows)  # from its table and its autotuner's choices
    autotuner.configs = configs
    try:
        wide_us = replay_us(runs)
    finally:
        autotuner.configs = own_configs
    wide = config_in_use(layer, rows)
    if held is not None and held_us < wide_us:  # the table's entry is what gets written
        gemlite_checks.forget_tuned(layer, rows)
        core.GEMLITE_TRITON_CONFIG_CACHE.setdefault(matmul_type, {})[tuned_key(layer, rows)] = held
    return held_us, held, wide_us, wide


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="config.json of the model shape")
    parser.add_argument("--rows", default="32,16", help="row counts, each standing for its "
                        "gemlite bucket (17-32, 9-16, ...)")
    parser.add_argument("--weights", default="int8", choices=("int8", "fp8", "int4"),
                        help="int4: the app's int4-wo numbers in gemlite's packing, group 128")
    parser.add_argument("--held-only", action="store_true",
                        help="no wider search: gemlite's own tuning of each shape and row "
                        "bucket, timed against bf16, its configs written (to ship tuned configs "
                        "for a model's shapes); also the only search for 64+ rows")
    parser.add_argument("--layers", default="qkv,o,gate_up,down",
                        help="which of the model's linear shapes (a wide search of all four "
                        "at one row count outlasts one GPU call)")
    parser.add_argument("--budget-s", type=float, default=500,
                        help="start no new shape after this many seconds")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    chosen = args.layers.split(",")
    shapes = linear_shapes(json.loads(Path(args.config).read_text()))
    if unknown := set(chosen) - set(shapes):
        parser.error(f"--layers: {', '.join(sorted(unknown))} (the shapes: {', '.join(shapes)})")
    if not torch.cuda.is_available():
        print("gemlite_search needs a CUDA GPU")
        return 2
    from model_utils.layers import gemlite_weights
    from model_utils.layers.fp8_weights import Fp8Linear
    from model_utils.layers.weight_only import Int4WeightOnlyLinear, Int8WeightOnlyLinear

    if problem := gemlite_weights.unavailable_reason(torch.device("cuda"), torch.bfloat16):
        print(problem)
        return 2
    import gemlite.core as core

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "config": Path(args.config).name, "weights": args.weights}
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    for name, (n, k) in ((name, shapes[name]) for name in chosen):
        if time.perf_counter() - start > args.budget_s:
            results.append({"layer": name, "skipped": "time"})
            continue
        # As many copies as the quantized weights need: bf16 cycles through as many, more than
        # it needs.
        weight_bytes = n * k // 2 if args.weights == "int4" else n * k
        linears = [torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
                   for _ in range(copies_for(weight_bytes))]
        with torch.no_grad():
            if args.weights == "int4":
                layers = [Int4WeightOnlyLinear(linear, 128, kernel="gemlite")
                          for linear in linears]
            else:
                quantize = Int8WeightOnlyLinear if args.weights == "int8" else Fp8Linear
                layers = [quantize(linear) for linear in linears]
        if not all(layer.gemlite_meta is not None or gemlite_weights.attach(layer)
                   for layer in layers):
            results.append({"layer": name, "skipped": "gemlite does not take this shape"})
            continue
        for rows in rows_list:
            x2 = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            bf16_us = replay_us([functools.partial(F.linear, x2, linear.weight)
                                 for linear in linears])
            tuning = time.perf_counter()
            if args.held_only:
                runs = [functools.partial(gemlite_weights.product, layer, x2) for layer in layers]
                held_us = wide_us = replay_us(runs)  # tunes first if it holds no config
                held = wide = config_in_use(layers[0], rows)
            else:
                held_us, held, wide_us, wide = search(layers, x2, rows)
            weight_gb = weight_bytes / 1e9
            row = {"layer": name, "n": n, "k": k, "rows": rows, "bf16_us": round(bf16_us, 1),
                   "gemlite_us": round(held_us, 1), "gemlite_config": held,
                   "wide_us": round(wide_us, 1), "wide_config": wide,
                   "wide_tb_s": round(weight_gb / wide_us * 1e6 / 1e3, 2),
                   "bf16_tb_s": round(2 * n * k / 1e9 / bf16_us * 1e6 / 1e3, 2),
                   "seconds": round(time.perf_counter() - tuning, 1)}
            results.append(row)
            print(json.dumps({key: v for key, v in row.items() if "config" not in key}),
                  flush=True)
            core.GemLiteLinear.cache_config(str(out / "gemlite-configs.json"))
            meta["elapsed_s"] = round(time.perf_counter() - start, 1)
            (out / "gemlite_search.json").write_text(json.dumps({"meta": meta,
                                                                  "results": results}, indent=2))
        del layers, linears
    (out / "gemlite_search.md").write_text(table(results, meta))
    print(table(results, meta))
    return 0


def table(results: list[dict], meta: dict) -> str:
    lines = [f"{meta['gpu']}, {meta['config']}, {meta['weights']} weights, torch {meta['torch']}",
             "", "| layer | N x K | rows | bf16 µs | gemlite µs (held config) | "
             "gemlite µs (wider search) | the faster x bf16 | weights TB/s (wider) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['layer']} | skipped: {r['skipped']} |||||||")
            continue
        lines.append(f"| {r['layer']} | {r['n']} x {r['k']} | {r['rows']} | {r['bf16_us']} | "
                     f"{r['gemlite_us']} | {r['wide_us']} | "
                     f"{r['bf16_us'] / min(r['wide_us'], r['gemlite_us']):.2f}x | "
                     f"{r['wide_tb_s']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
