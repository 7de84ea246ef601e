"""One weight kernel's product at one shape and row count, for a profiler to look inside: the
kernels int4_kernels.py and quant_candidates.py time (mslk_rows, mslk_gemv, MSLK's own GEMM,
int8_rows, bf16's cuBLAS) on random weights of the layout each reads (speed does not depend on
the values). It prints the product's µs (CUDA-graph replays, as int4_kernels.py) and runs it once
more inside an NVTX range named "profiled", so that Nsight Compute sees that launch alone:

    ncu --nvtx --nvtx-include "profiled/" --section WarpStateStats ... \\
        python benchmarks/kernel_profile.py --kernel mslk_rows --shape 37888x3584 --rows 8

(`STEPS=profile benchmarks/gpu_modes.sh` runs it so, with the sections that say where a kernel's
time goes: occupancy, memory throughput, and what its warps stalled on.)
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gemlite_search import copies_for, replay_us  # noqa: E402

from model_utils.layers import int8_rows, mslk_gemv, mslk_rows  # noqa: E402

KERNELS = ("mslk_rows", "mslk_gemv", "mslk", "int8_rows", "bf16")
GROUP = 128


def product_of(kernel: str, n: int, k: int, launch: tuple[int, ...] | None):
    """A function of x2 [M, K] computing x2 @ W.T through `kernel`, W random in its layout."""
    cuda = torch.device("cuda")
    if kernel == "bf16":
        weight = torch.randn(n, k, dtype=torch.bfloat16, device=cuda)
        return lambda x2: F.linear(x2, weight)
    if kernel == "int8_rows":
        packed = int8_rows.pack(torch.randint(-127, 128, (n, k), dtype=torch.int8, device=cuda))
        scales = torch.rand(n, dtype=torch.bfloat16, device=cuda) / 64
        space = mslk_gemv.workspace(mslk_gemv.MOST_ROWS, n, cuda)
        return lambda x2: int8_rows.product(x2, packed, scales, launch=launch, space=space)
    # MSLK's int4 copy: int8 [N, K/2], scales and zeros [K/group, N]
    weight = torch.randint(-128, 128, (n, k // 2), dtype=torch.int8, device=cuda)
    scales = torch.rand(k // GROUP, n, dtype=torch.bfloat16, device=cuda) / 64
    zeros = torch.randn(k // GROUP, n, dtype=torch.bfloat16, device=cuda) / 64
    if kernel == "mslk":
        import mslk  # noqa: F401 - registers torch.ops.mslk

        return lambda x2: torch.ops.mslk.bf16i4bf16_shuffled(x2, weight, scales, zeros)
    space = mslk_gemv.workspace(mslk_gemv.MOST_ROWS, n, cuda)
    chosen = mslk_rows.product if kernel == "mslk_rows" else mslk_gemv.gemv
    return lambda x2: chosen(x2, weight, scales, zeros, launch=launch, space=space)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", choices=KERNELS, default="mslk_rows")
    parser.add_argument("--shape", default="37888x3584", help="N x K (outputs x inputs)")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--launch", help="the kernel's launch, comma-separated (mslk_rows, "
                                         "mslk_gemv, int8_rows); its configured one if left out")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernel_profile.py runs on a CUDA GPU")
    n, k = (int(v) for v in args.shape.lower().split("x"))
    launch = tuple(int(v) for v in args.launch.split(",")) if args.launch else None
    weight_bytes = n * k * {"bf16": 2, "int8_rows": 1}.get(args.kernel, 0.5)
    # copies enough to miss L2 in the timing, as int4_kernels.py; the profiled launch reads
    # the first
    products = [product_of(args.kernel, n, k, launch) for _ in range(copies_for(weight_bytes))]
    x2 = torch.randn(args.rows, k, dtype=torch.bfloat16, device="cuda")
    with torch.inference_mode():
        us = replay_us([functools.partial(product, x2) for product in products])
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("profiled")
        products[0](x2)
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "kernel": args.kernel, "n": n,
                      "k": k, "rows": args.rows, "launch": launch, "us": round(us, 1),
                      "weight_tb_per_s": round(weight_bytes / us / 1e6, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
