"""The int4 kernels that can multiply the app's int4-wo weights on a Hopper GPU, side by side with
bf16's cuBLAS, per linear shape of a model and per row count: gemlite's (the app's kernel today,
with the configs it holds) and MSLK's CUTLASS mixed-input GEMMs (pip `mslk-cuda`: prebuilt, no
compiling at install), `bf16i4bf16_shuffled` (weights pre-shuffled once at load) and
`bf16i4bf16_rowwise` (plain packing), from 64 rows gemlite's copy dequantized to bf16 then cuBLAS
(`dequant_cublas`, prompts' alternative), and the app's Triton GEMV over MSLK's shuffled copy for
up to 32 rows (mslk_gemv, through the layout read off MSLK's preshuffle; `--gemv-search` times its
launches per shape at 1, 2, 4, 8, 16 and 32 rows first and writes the fastest into
model_utils/layers/mslk_gemv_configs.json, which the timings then use, and after the timings up to
how many rows it beat MSLK's GEMM, which int4 layers on MSLK's kernel then use), and mslk_rows'
tensor-core kernel over the same copy from 2 rows (`--rows-search`: the same search for its launches,
written under "rows_kernel", and after the timings which rows each kernel serves: the GEMV up to
where it beat both others ("gemv_rows"), this kernel from there up to where it beat MSLK's GEMM
("rows_kernel_rows")). All read the app's
numbers unchanged: MSLK's bf16 form is w = q_signed * scale + zero with q_signed = q - 8, the app's
own (int_quantization).

Each is timed as CUDA-graph replays cycling through copies of the weight that overflow the L2
cache (gemlite_search.replay_us), and checked against x @ the dequantized weight in fp32 (the
largest error over the largest output). Also tried: one compile of MSLK's op with
torch.compile(fullgraph, dynamic rows), which the engine's compiled step needs. Prints a table,
writes JSON.

    python benchmarks/int4_kernels.py --out /tmp/int4-kernels.json   # on a GPU, mslk installed
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
sys.path.insert(0, str(ROOT / "benchmarks"))

from gemlite_search import copies_for, linear_shapes, replay_us  # noqa: E402

from model_utils.layers import gemlite_weights, mslk_gemv, mslk_int4, mslk_rows  # noqa: E402
from model_utils.layers.gemlite_checks import off_product  # noqa: E402
from model_utils.layers.int_quantization import dequantize_int4, quantize_int4  # noqa: E402
from model_utils.layers.weight_only import Int4WeightOnlyLinear  # noqa: E402


def kernels_for(linear: torch.nn.Linear, group: int, mslk: bool) -> dict:
    """name -> a function of x2 [M, K] giving x2 @ w.T for this weight's int4 numbers."""
    q, scales, zeros = quantize_int4(linear.weight, group)
    found = {}
    layer = Int4WeightOnlyLinear(linear, group, kernel="gemlite")
    gemlite_weights.borrow_configs(layer)
    found["gemlite"] = functools.partial(gemlite_weights.product, layer)
    # prompts' alternative (the int4-wo-dequant-prompts candidate): gemlite's copy dequantized
    # to bf16 by the compiled unpacking, then cuBLAS
    found["dequant_cublas"] = lambda x2: x2 @ gemlite_weights.dequantized_int4(layer, x2.dtype)
    if mslk:
        shuffled = mslk_int4.pack(q, scales, zeros)
        # the unshuffled layout: MSLK's signed nibbles, its scales and zeros as they are
        plain = (mslk_int4.signed_nibbles(q), scales.t().contiguous(), zeros.t().contiguous())
        found["mslk_shuffled"] = lambda x2: torch.ops.mslk.bf16i4bf16_shuffled(x2, *shuffled)
        found["mslk_rowwise"] = lambda x2: torch.ops.mslk.bf16i4bf16_rowwise(x2, *plain)
        if mslk_int4.gemv_reads_layout(linear.weight.device):
            found["mslk_gemv"] = functools.partial(gemv_product, shuffled)
            found["mslk_rows"] = functools.partial(rows_product, shuffled)
    return found


DEQUANT_FROM_ROWS = 64  # rows from which dequantizing for cuBLAS is timed: prompts'


def gemv_product(shuffled, x2, launch=None):
    """The GEMV as the engine calls it (the layer's op), or with another launch; either way
    with a workspace kept across calls, as each layer keeps its own."""
    n = shuffled[0].shape[0]
    if n not in _spaces:
        _spaces[n] = mslk_gemv.workspace(mslk_gemv.MOST_ROWS, n, shuffled[0].device)
    if launch is None:
        return mslk_int4.product(x2, *shuffled, mslk_gemv.MOST_ROWS, *_spaces[n])
    return mslk_gemv.gemv(x2, *shuffled, launch=launch, space=_spaces[n])


def rows_product(shuffled, x2, launch=None):
    """mslk_rows' tensor-core kernel over MSLK's copy, in a kept workspace as gemv_product."""
    n = shuffled[0].shape[0]
    if n not in _spaces:
        _spaces[n] = mslk_gemv.workspace(mslk_gemv.MOST_ROWS, n, shuffled[0].device)
    return mslk_rows.product(x2, *shuffled, launch=launch, space=_spaces[n])


_spaces: dict = {}  # a GEMV workspace per output width


def launch_search(sets: list, k: int, reference: torch.Tensor, kernel: str = "mslk_gemv",
                  row_counts=(1, 2, 4, 8, 16, 32)) -> dict:
    """{rows: [(launch, µs)]} for every launch `kernel` searches (mslk_gemv.SEARCHED, or
    mslk_rows.SEARCHED) at `row_counts` (up to mslk_gemv.MOST_ROWS; the copies in `sets` cycled
    as in the timings); a launch whose product the load's check would refuse (against
    `reference`, the first copy's weight) is kept with why instead of its time, so that it is
    never chosen."""
    launches = mslk_rows.SEARCHED if kernel == "mslk_rows" else mslk_gemv.SEARCHED
    timed = {}  # a count between those takes the next one's launch (config)
    for rows in row_counts:
        x2 = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        expected = x2.float() @ reference.T
        timed[rows] = []
        for launch in launches:
            if launch[6:] == (1,) and (rows == 1 or rows > mslk_gemv.FMA_ROWS):
                continue  # one row takes the FMA kernel anyway; more than its rows, never
            try:
                wrong = off_product(sets[0][kernel](x2, launch=launch).float(), expected)
                us = (f"WrongProduct: {wrong}" if wrong else
                      round(replay_us([functools.partial(s[kernel], x2, launch=launch)
                                       for s in sets]), 1))
            except torch.AcceleratorError as error:
                # a fault (an illegal address) leaves the process's CUDA context unusable:
                # say which launch did it rather than fail at the next allocation
                raise SystemExit(f"{kernel} launch {launch} at {rows} rows faulted: "
                                 f"{str(error).splitlines()[0]}") from error
            except Exception as error:  # noqa: BLE001 - a launch Triton cannot build
                us = f"{type(error).__name__}: {str(error)[:120]}"
            timed[rows].append((list(launch), us))
    return timed


def fastest(timed: dict) -> dict:
    """{rows: the launch of the shortest time} (a count where every launch failed: none)."""
    return {str(rows): min(ok, key=lambda t: t[1])[0] for rows, runs in timed.items()
            if (ok := [t for t in runs if not isinstance(t[1], str)])}


def write_gemv_configs(gpu: str, n: int, k: int, timed: dict) -> dict:
    """The fastest launch at each row count into mslk_gemv.CONFIGS_FILE for this GPU."""
    best = fastest(timed)
    update_gemv_configs(gpu, n, k, best)
    return best


def gemv_crossover(rows_timed: list[dict], kernel: str = "mslk_gemv",
                   rivals: tuple[str, ...] = ("mslk_shuffled",)) -> int:
    """Up to how many rows `kernel` beat every one of `rivals` at every count timed for one
    shape (of the counts in rows_timed, from the smallest)."""
    served = 0
    for row in sorted(rows_timed, key=lambda r: r["rows"]):
        ours = row.get(f"{kernel}_us")
        theirs = [row.get(f"{rival}_us") for rival in rivals]
        if not (isinstance(ours, float) and all(isinstance(t, float) and ours < t
                                                 for t in theirs)):
            break
        served = row["rows"]
    return served


def rows_kernel_split(rows_timed: list[dict]) -> dict:
    """The row counts each of a shape's three products serves, from its timings: the GEMV up
    to where it beat both others, then the tensor-core kernel up to where it beat MSLK's GEMM
    (0: the next one takes over), MSLK's GEMM above."""
    gemv_rows = gemv_crossover(rows_timed, "mslk_gemv", ("mslk_shuffled", "mslk_rows"))
    above = [r for r in rows_timed if r["rows"] > gemv_rows]
    return {"gemv_rows": gemv_rows,
            "rows_kernel_rows": gemv_crossover(above, "mslk_rows") or 0}


def update_gemv_configs(gpu: str, n: int, k: int, entries: dict) -> None:
    path = mslk_gemv.CONFIGS_FILE
    configs = json.loads(path.read_text()) if path.exists() else {}
    configs.setdefault(gpu, {}).setdefault(f"{n}x{k}", {}).update(entries)
    path.write_text(json.dumps(configs, indent=1, sort_keys=True) + "\n")
    mslk_gemv._shape_configs.cache_clear()


def reference_weight(linear: torch.nn.Linear, group: int) -> torch.Tensor:
    return dequantize_int4(*quantize_int4(linear.weight, group), torch.float32)


def error_of(fn, x2: torch.Tensor, weight: torch.Tensor) -> float:
    expected = x2.float() @ weight.t()
    got = fn(x2).float()
    return round(((got - expected).abs().max() / expected.abs().max()).item(), 5)


def compiles(fn, k: int) -> str:
    """Whether torch.compile takes the kernel in a full graph with dynamic rows."""
    try:
        compiled = torch.compile(lambda x2: fn(x2) * 1, fullgraph=True, dynamic=True)
        for rows in (3, 5):
            x2 = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            torch.testing.assert_close(compiled(x2), fn(x2) * 1)
        return "yes"
    except Exception as error:  # noqa: BLE001 - what it says is the finding
        return f"no: {type(error).__name__}: {str(error).splitlines()[0][:200]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "benchmarks/configs/"
                                                "qwen2.5-7b-instruct.config.json"))
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,1024")
    parser.add_argument("--layers", default="",
                        help="some of the shapes only, e.g. down or qkv,o (default: every one)")
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--out", default="int4-kernels.json")
    parser.add_argument("--gemv-search", action="store_true",
                        help="time mslk_gemv's launches per shape and row count first and write "
                             "the fastest into model_utils/layers/mslk_gemv_configs.json")
    parser.add_argument("--rows-search", action="store_true",
                        help="the same for mslk_rows' tensor-core kernel (from 2 rows), and up "
                             "to how many rows it beat MSLK's GEMM")
    args = parser.parse_args()
    if problem := gemlite_weights.unavailable_reason(torch.device("cuda"), torch.bfloat16):
        raise SystemExit(problem)
    mslk_problem = mslk_int4.unavailable_reason(torch.device("cuda"), torch.bfloat16)
    if mslk_problem is None:
        import mslk
        mslk_version = mslk.__version__
        layout_found = ("the GEMV's" if mslk_int4.gemv_reads_layout(torch.device("cuda"))
                        else "not the GEMV's (the log says why)")
    else:
        mslk_version, layout_found = f"not used: {mslk_problem}", None
    shapes = linear_shapes(json.loads(Path(args.config).read_text()))
    if args.layers:
        chosen = args.layers.split(",")
        if unknown := set(chosen) - set(shapes):
            raise SystemExit(f"--layers: no shape {sorted(unknown)}; the shapes: {list(shapes)}")
        shapes = {name: shapes[name] for name in chosen}
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "mslk": mslk_version, "mslk_layout": layout_found, "config": Path(args.config).name,
            "group": args.group}
    print(json.dumps(meta), flush=True)
    rows_list = [int(r) for r in args.rows.split(",")]
    results, compiled = [], {}
    for name, (n, k) in shapes.items():
        linears = [torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
                   for _ in range(copies_for(n * k // 2))]
        start = time.perf_counter()
        with torch.no_grad():
            sets = [kernels_for(linear, args.group, mslk_problem is None)
                    for linear in linears]
            reference = reference_weight(linears[0], args.group)
        print(f"{name}: packed {len(sets)} copies in {time.perf_counter() - start:.1f} s",
              flush=True)
        kernels = sets[0]
        if "mslk_gemv" in kernels and args.gemv_search:
            timed = launch_search(sets, k, reference)
            best = write_gemv_configs(meta["gpu"], n, k, timed)
            meta.setdefault("gemv_search", {})[name] = {"timed": timed, "best": best}
            print(f"{name}: gemv launches {timed}; fastest {best}", flush=True)
        if "mslk_rows" in kernels and args.rows_search:
            timed = launch_search(sets, k, reference, "mslk_rows", (2, 4, 8, 16, 32))
            best = fastest(timed)
            update_gemv_configs(meta["gpu"], n, k, {"rows_kernel": best})
            meta.setdefault("rows_search", {})[name] = {"timed": timed, "best": best}
            print(f"{name}: rows kernel launches {timed}; fastest {best}", flush=True)
        for kernel in kernels:
            if kernel not in compiled:
                compiled[kernel] = compiles(kernels[kernel], k)
                print(f"compiles {kernel}: {compiled[kernel]}", flush=True)
        for rows in rows_list:
            x2 = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            row = {"layer": name, "n": n, "k": k, "rows": rows,
                   "bf16_us": round(replay_us([functools.partial(F.linear, x2, linear.weight)
                                               for linear in linears]), 1)}
            for kernel in kernels:
                if (kernel in ("mslk_gemv", "mslk_rows") and rows > mslk_gemv.MOST_ROWS
                        or kernel == "dequant_cublas" and rows < DEQUANT_FROM_ROWS):
                    continue
                try:
                    row[f"{kernel}_us"] = round(replay_us([functools.partial(s[kernel], x2)
                                                           for s in sets]), 1)
                    row[f"{kernel}_error"] = error_of(kernels[kernel], x2, reference)
                except Exception as error:  # noqa: BLE001 - a shape a kernel refuses
                    row[f"{kernel}_us"] = f"{type(error).__name__}: {str(error)[:160]}"
            results.append(row)
            print(json.dumps(row), flush=True)
            Path(args.out).write_text(json.dumps({"meta": meta, "compiles": compiled,
                                                  "results": results}, indent=1))
        if "mslk_gemv" in kernels and args.gemv_search:
            served = gemv_crossover([r for r in results if r["layer"] == name])
            update_gemv_configs(meta["gpu"], n, k, {"gemv_rows": served})
            print(f"{name}: the GEMV serves up to {served} rows", flush=True)
        if "mslk_rows" in kernels and args.rows_search:
            split = rows_kernel_split([r for r in results if r["layer"] == name])
            update_gemv_configs(meta["gpu"], n, k, split)
            print(f"{name}: the GEMV serves up to {split['gemv_rows']} rows, the tensor-core "
                  f"kernel up to {split['rows_kernel_rows']}", flush=True)
        del linears, sets, kernels, reference
        torch.cuda.empty_cache()
    if "mslk_shuffled" in compiled:
        meta["mslk_group_64"] = group_64_check(shapes["qkv"])
        print("mslk at groups of 64:", meta["mslk_group_64"], flush=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "compiles": compiled,
                                              "results": results}, indent=1))
    print(table(results, meta))
    return 0


def group_64_check(shape: tuple[int, int]) -> dict:
    """Whether MSLK's kernels take groups of 64 (the finer int4 the quality runs weigh)."""
    n, k = shape
    linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    found = {}
    try:
        kernels, reference = kernels_for(linear, 64, mslk=True), reference_weight(linear, 64)
    except Exception as error:  # noqa: BLE001 - the packing refused it
        return {"packing": f"{type(error).__name__}: {str(error)[:200]}"}
    for kernel in ("mslk_shuffled", "mslk_rowwise"):
        for rows in (1, 128):
            x2 = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            try:
                found[f"{kernel}_{rows}_error"] = error_of(kernels[kernel], x2, reference)
            except Exception as error:  # noqa: BLE001
                found[f"{kernel}_{rows}_error"] = f"{type(error).__name__}: {str(error)[:200]}"
    return found


def table(results: list[dict], meta: dict) -> str:
    kernels = list(dict.fromkeys(c[:-3] for r in results for c in r  # every row's, in order
                                 if c.endswith("_us") and c != "bf16_us"))
    lines = [f"{meta['gpu']}, {meta['config']}, int4 group {meta['group']}, torch "
             f"{meta['torch']}, mslk {meta['mslk']}", "",
             "| layer | rows | bf16 µs | " + " | ".join(f"{k} µs (x bf16)" for k in kernels)
             + " |", "|---|---|---|" + "---|" * len(kernels)]
    for r in results:
        cells = []
        for kernel in kernels:
            us = r.get(f"{kernel}_us")
            cells.append(f"{us} ({r['bf16_us'] / us:.2f}x)" if isinstance(us, float) else "-")
        lines.append(f"| {r['layer']} | {r['rows']} | {r['bf16_us']} | " + " | ".join(cells)
                     + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
