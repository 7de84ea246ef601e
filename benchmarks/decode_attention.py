"""Decode attention per layer on a GPU: the paged Triton kernel against sdpa over a dense cache.

    python benchmarks/decode_attention.py --out decode_attention.json [--tune]

For each (rows, tokens per row) it times one decode step's attention for one layer of the
Qwen2.5-7B shape (28 query heads over 4 KV heads, head size 128, bf16): 28 calls captured in
one CUDA graph, each on another layer's cache (enough layers that the caches do not fit the
L2), the graph replayed and timed with CUDA events; the figure is per call. Beside it: sdpa
with a boolean mask over a dense [rows, kv_heads, tokens, d] cache (a KV head's query heads as
its queries: what the engine's attention was before the paged cache), and the time the bytes
of the keys and values take at the copy bandwidth measured in the same run. Every kernel
result is checked against the torch reference first. --tune also sweeps the kernel's tile and
warps on five shapes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model_utils.runtime import decode_kernel  # noqa: E402
from model_utils.runtime.paged_attention import reference_decode  # noqa: E402

Q_HEADS, KV_HEADS, DIM, PAGE = 28, 4, 128, 16
CALLS = 28  # one step: one call per layer
L2_BYTES = 60 * 2**20


def copy_bandwidth() -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    return 2 * a.numel() * 10 / (start.elapsed_time(end) / 1000)


def paged_case(rows: int, lengths: list[int], layers: int, dtype=torch.bfloat16):
    """`layers` pools with the rows' tokens in shuffled blocks, the table and lengths."""
    per_row = [math.ceil(n / PAGE) for n in lengths]
    blocks = 1 + sum(per_row)
    g = torch.Generator(device="cuda").manual_seed(0)
    pools = [(torch.randn(blocks, PAGE, KV_HEADS, DIM, device="cuda", dtype=dtype, generator=g),
              torch.randn(blocks, PAGE, KV_HEADS, DIM, device="cuda", dtype=dtype, generator=g))
             for _ in range(layers)]
    order = (torch.randperm(blocks - 1, device="cuda", generator=g) + 1).int()
    width = max(per_row) + 1
    table = torch.zeros(rows, width, dtype=torch.int32, device="cuda")
    at = 0
    for row, n in enumerate(per_row):
        table[row, :n] = order[at:at + n]
        at += n
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    return pools, table, lens


def timed_graph(calls) -> float:
    """Microseconds per call of `calls` (a list of thunks) captured as one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            for call in calls:
                call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / 10 / len(calls))
    return sorted(times)[len(times) // 2]


def kernel_time(rows, lengths, splits, **tuning) -> tuple[float, float]:
    """(us per call, relative error against the reference) of the paged kernel, its split
    size as the engine sets it (decode_kernel.split_size)."""
    kv_bytes = 2 * sum(lengths) * KV_HEADS * DIM * 2
    layers = max(2, min(CALLS, math.ceil(4 * L2_BYTES / kv_bytes)))
    pools, table, lens = paged_case(rows, lengths, layers)
    query = torch.randn(rows, Q_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    scale = DIM ** -0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    split = torch.tensor([decode_kernel.split_size(sum(lengths), KV_HEADS, sms,
                                                   tuning.get("block_n", decode_kernel.BLOCK_N))],
                         dtype=torch.int32, device="cuda")
    out = decode_kernel.paged_decode(query, *pools[0], table, lens, split, scale, 0, splits,
                                     **tuning)
    ref = reference_decode(query.float(), pools[0][0].float(), pools[0][1].float(), table, lens,
                           scale, longest=max(lengths))
    error = ((out.float() - ref).norm() / ref.norm()).item()
    calls = [lambda i=i: decode_kernel.paged_decode(query, *pools[i % layers], table, lens,
                                                    split, scale, 0, splits, **tuning)
             for i in range(CALLS)]
    return timed_graph(calls), error


def sdpa_time(rows, lengths) -> float:
    """us per call of sdpa with a boolean mask over a dense cache as long as the longest row."""
    width = max(lengths)
    kv_bytes = 2 * rows * width * KV_HEADS * DIM * 2
    layers = max(2, min(CALLS, math.ceil(4 * L2_BYTES / kv_bytes)))
    caches = [(torch.randn(rows, KV_HEADS, width, DIM, device="cuda", dtype=torch.bfloat16),
               torch.randn(rows, KV_HEADS, width, DIM, device="cuda", dtype=torch.bfloat16))
              for _ in range(layers)]
    mask = (torch.arange(width, device="cuda")[None] <
            torch.tensor(lengths, device="cuda")[:, None])[:, None, None, :]
    query = torch.randn(rows, KV_HEADS, Q_HEADS // KV_HEADS, DIM, device="cuda",
                        dtype=torch.bfloat16)
    calls = [lambda i=i: F.scaled_dot_product_attention(query, *caches[i % layers],
                                                        attn_mask=mask)
             for i in range(CALLS)]
    return timed_graph(calls)


def shapes() -> list[tuple[str, int, list[int]]]:
    out = []
    for rows in (1, 8, 32):
        for tokens in (128, 1024, 4096, 16384, 32768):
            if rows * tokens <= 32 * 16384:
                out.append((f"{rows} x {tokens}", rows, [tokens] * rows))
    out.append(("7 x 128 + 1 x 16384", 8, [128] * 7 + [16384]))
    return out


def tune(bandwidth: float) -> list[dict]:
    """The kernel's tile and warps on four shapes (split size as the engine sets it)."""
    from model_utils.runtime.kv_cache import decode_splits

    results = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for rows, lengths in [(1, [4096]), (1, [32768]), (8, [16384] * 8), (32, [4096] * 32),
                          (8, [128] * 7 + [16384])]:
        for block_n, warps in itertools.product((32, 64, 128), (4, 8)):
            splits = decode_splits(rows, KV_HEADS, sms)
            micros, error = kernel_time(rows, lengths, splits, block_n=block_n, warps=warps)
            results.append({"rows": rows, "tokens": lengths[-1], "block_n": block_n,
                            "warps": warps, "us": round(micros, 2), "error": error})
            bound = 2 * sum(lengths) * KV_HEADS * DIM * 2 / bandwidth * 1e6
            print(f"  {rows} rows, longest {lengths[-1]}: block {block_n} warps {warps}: "
                  f"{micros:.1f} us (bound {bound:.1f})", flush=True)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="decode_attention.json")
    parser.add_argument("--tune", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_attention.py needs a CUDA GPU", file=sys.stderr)
        return 2
    start = time.perf_counter()
    bandwidth = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows_out = []
    print(f"{torch.cuda.get_device_name(0)}, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print("| rows x tokens | paged kernel us | sdpa + mask us | bytes bound us | kernel / bound "
          "| rel. error |")
    print("|---|---|---|---|---|---|")
    from model_utils.runtime.kv_cache import decode_splits

    for name, rows, lengths in shapes():
        splits = decode_splits(rows, KV_HEADS, sms)
        micros, error = kernel_time(rows, lengths, splits)
        torch.cuda.empty_cache()
        dense = sdpa_time(rows, lengths)
        torch.cuda.empty_cache()
        bound = 2 * sum(lengths) * KV_HEADS * DIM * 2 / bandwidth * 1e6
        rows_out.append({"shape": name, "rows": rows, "lengths": lengths[:1] + lengths[-1:],
                         "kernel_us": round(micros, 2), "sdpa_mask_us": round(dense, 2),
                         "bound_us": round(bound, 2), "error": error, "max_splits": splits})
        print(f"| {name} | {micros:.1f} | {dense:.1f} | {bound:.1f} | {micros / bound:.1f}x "
              f"| {error:.1e} |", flush=True)
    tuned = tune(bandwidth) if args.tune else []
    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "bandwidth_tb_s": bandwidth / 1e12,
            "seconds": round(time.perf_counter() - start, 1)}
    Path(args.out).write_text(json.dumps({"meta": meta, "shapes": rows_out, "tune": tuned},
                                         indent=1))
    print(f"wrote {args.out} in {meta['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
