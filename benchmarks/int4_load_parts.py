"""Where an int4-wo load's seconds go on a GPU: each part of quantizing one layer of each weight
shape of a model (the Qwen2.5-7B shape by default, fused as the engine fuses it), timed apart
and multiplied by the number of layers. Prints a table and writes JSON.

    python benchmarks/int4_load_parts.py --out /tmp/parts.json

With --first-launches SHAPE (qkv, o, gate_up or down) it times instead each row count's first
launch of gemlite's kernel in this process and the next one, for one layer of that shape: what
a load's kernel check pays per row bucket (run it twice: the second process finds Triton's disk
cache full).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path
from unittest import mock

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model_utils.layers import gemlite_checks, gemlite_weights, int_quantization
from model_utils.layers.int_quantization import dequantize_int4, quantize_int4
from model_utils.layers.weight_only import Int4WeightOnlyLinear

# (out features, in features) of the fused layers of one decoder layer
SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}


def seconds(work, repeats: int = 3) -> float:
    """The mean wall time of `work`, its GPU work included, after one untimed run."""
    work()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        work()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def first_call_seconds(work) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    work()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def parts_of(name: str, n: int, k: int, group: int) -> dict:
    device = torch.device("cuda")
    host = torch.randn(n, k, dtype=torch.bfloat16) * 0.02
    pinned = host.pin_memory()
    linear = nn.Linear(k, n, bias=name == "qkv", dtype=torch.bfloat16, device=device)
    linear.weight.data.copy_(host)
    row = {"layer": name, "shape": f"{n}x{k}"}
    row["move_pageable_s"] = seconds(lambda: host.to(device))
    row["move_pinned_s"] = seconds(lambda: pinned.to(device, non_blocking=True))
    row["round_range_search_s"] = seconds(lambda: quantize_int4(linear.weight, group))
    with mock.patch.object(int_quantization, "INT4_RANGE_FRACTIONS", (1.0,)):
        row["round_min_max_s"] = seconds(lambda: quantize_int4(linear.weight, group))
    row["layer_gemlite_s"] = seconds(lambda: Int4WeightOnlyLinear(linear, group, kernel="gemlite"))
    row["layer_tinygemm_s"] = seconds(lambda: Int4WeightOnlyLinear(linear, group,
                                                                   kernel="tinygemm"))
    layer = Int4WeightOnlyLinear(linear, group, kernel="gemlite")
    gemlite_weights.borrow_configs(layer)

    def check():
        gemlite_checks.check_kernels(layer, weight_rows=lambda rows: dequantize_int4(
            *quantize_int4(linear.weight[rows], group), torch.float32))
    row["check_first_s"] = first_call_seconds(check)
    row["check_again_s"] = seconds(check, repeats=1)
    return row


def first_launches(name: str, group: int) -> None:
    n, k = SHAPES[name]
    linear = nn.Linear(k, n, dtype=torch.bfloat16, device="cuda")
    layer = Int4WeightOnlyLinear(linear, group, kernel="gemlite")
    gemlite_weights.borrow_configs(layer)
    print(f"| rows | kernel | row bucket | first launch ms | next launch ms |  ({name}, {n}x{k})")
    print("|---|---|---|---|---|")
    for rows in (1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
        launch = functools.partial(gemlite_weights.product, layer,
                                   torch.randn(rows, k, dtype=torch.bfloat16, device="cuda"))
        first, again = first_call_seconds(launch), first_call_seconds(launch)
        kernel, bucket, _ = gemlite_weights.config_signature(layer, rows)
        print(f"| {rows} | {kernel} | {bucket} | {first * 1e3:.1f} | {again * 1e3:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=28, help="decoder layers of the model")
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--out", default="int4-load-parts.json",
                        help="the parts' JSON (--first-launches prints its table only)")
    parser.add_argument("--first-launches", choices=sorted(SHAPES), metavar="SHAPE",
                        help="time each row count's first launch for one layer of this shape")
    args = parser.parse_args()
    reason = gemlite_weights.unavailable_reason(torch.device("cuda"), torch.bfloat16)
    if reason:
        raise SystemExit(reason)
    if args.first_launches:
        return first_launches(args.first_launches, args.group)
    rows = [parts_of(name, n, k, args.group) for name, (n, k) in SHAPES.items()]
    columns = [c for c in rows[0] if c.endswith("_s")]
    print("| layer | shape | " + " | ".join(c[:-2] + " ms" for c in columns) + " |")
    print("|" + "---|" * (len(columns) + 2))
    for row in rows:
        print(f"| {row['layer']} | {row['shape']} | "
              + " | ".join(f"{row[c] * 1e3:.1f}" for c in columns) + " |")
    model = {c: sum(r[c] for r in rows) * (1 if c.startswith("check") else args.layers)
             for c in columns}
    print(f"| whole model ({args.layers} layers; checks once a shape) | | "
          + " | ".join(f"{model[c] * 1e3:.0f}" for c in columns) + " |")
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "group": args.group, "layers": args.layers}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "shapes": rows, "whole_model_s": model}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
