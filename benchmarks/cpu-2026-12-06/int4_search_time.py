"""Seconds to quantize one bf16 matrix to int4 (groups of 128) on this CPU: each group's range
searched (int_quantization.INT4_RANGE_FRACTIONS) against its min-max alone, best of three.

    python benchmarks/cpu-2026-12-06/int4_search_time.py > int4-search-time.json
"""

import json
import time

import torch

from model_utils.layers import int_quantization

SEARCHED = int_quantization.INT4_RANGE_FRACTIONS


def seconds(weight: torch.Tensor, fractions: tuple) -> float:
    int_quantization.INT4_RANGE_FRACTIONS = fractions
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        int_quantization.quantize_int4(weight, 128)
        best = min(best, time.perf_counter() - start)
    return round(best, 3)


torch.manual_seed(0)
rows = []
for shape in [(3584, 3584), (2048, 18944), (37888, 3584)]:
    weight = torch.randn(*shape).bfloat16()
    rows.append({"shape": shape, "threads": torch.get_num_threads(),
                 "min_max_s": seconds(weight, (1.0,)), "searched_s": seconds(weight, SEARCHED)})
print(json.dumps({"fractions": SEARCHED, "torch": torch.__version__, "rows": rows}, indent=1))
