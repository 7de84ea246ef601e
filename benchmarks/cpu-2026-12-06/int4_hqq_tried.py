"""int4-wo's KL against fp32 with HQQ's zero-point refinement (hqq 0.2.8.post1's
optimize_weights_proximal_legacy: proximal steps on an lp-norm (p = 0.7) of the rounding error,
scales kept) after the mode's range search, or from min-max as HQQ itself starts, in groups of
128 and 64, beside the shipped rounding and nf4, on peaked models. One bench process per variant.
hqq's optimize.py is loaded from its unpacked sdist (`pip download --no-deps hqq==0.2.8.post1`):
installing hqq would have transformers import all of it.

    HQQ_OPTIMIZE=/tmp/hqq-0.2.8.post1/hqq/core/optimize.py \\
        python benchmarks/cpu-2026-12-06/int4_hqq_tried.py /tmp/peaked400 /tmp/peaked256 /tmp/peaked128
"""

import json
import subprocess
import sys

VARIANT = """
import dataclasses, importlib.util, os
import torch
import model_utils.layers.int_quantization as iq
from model_utils.loading import modes

spec = importlib.util.spec_from_file_location("hqq_optimize", os.environ["HQQ_OPTIMIZE"])
hqq = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hqq)
searched = iq._quantize_int4_rows


def refined(weight, group):
    n, k = weight.shape
    if {start!r} == "search":
        _, scales, zeros = searched(weight, group)
    else:
        w = weight.float().reshape(n, k // group, group)
        scales, zeros = iq._int4_range(w.amin(-1), w.amax(-1))
    s = scales.float().reshape(-1, 1)
    shift = zeros.float().reshape(-1, 1) - 8 * s  # w ~ q * s + shift, q in 0..15
    _, scale_h, zero_h = hqq.optimize_weights_proximal_legacy(
        weight.float().reshape(-1, group), 1.0 / s, -shift / s, [0, 15], axis=1, device="cpu")
    zeros = (-zero_h / scale_h + 8 * s).to(torch.bfloat16).reshape(n, k // group)
    s = scales.float().unsqueeze(-1)
    x = weight.float().reshape(n, k // group, group)
    q = ((x - (zeros.float().unsqueeze(-1) - 8 * s)) / s).round_().clamp_(0, 15)
    return q.to(torch.uint8).reshape(n, k), scales, zeros


if {start!r} != "shipped":
    iq._quantize_int4_rows = refined
modes.MODES["int4-wo"] = dataclasses.replace(modes.MODES["int4-wo"], group_size={group})
from model_utils.bench.run import main
main(["--model", {model!r}, "--modes", "fp32,int4-wo,nf4", "--batch", "1",
      "--prompt-tokens", "32", "--new-tokens", "8", "--match-prompts", "1", "--no-logprobs",
      "--quality-positions", "384", "--out", "/tmp/int4-hqq-tried.json"])
"""
VARIANTS = [("shipped", 128), ("search", 128), ("minmax", 128), ("minmax", 64)]

results = []
for model in sys.argv[1:]:
    for start, group in VARIANTS:
        code = VARIANT.format(start=start, model=model, group=group)
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
        rows = json.load(open("/tmp/int4-hqq-tried.json"))["rows"]
        results.append({"model": model, "start": start, "group": group,
                        **{r["mode"]: {"kl": r["kl_vs_fp32"], "top1": r["top1_vs_fp32"]}
                           for r in rows if r["mode"] != "fp32"}})
        print(json.dumps(results[-1]), file=sys.stderr)
print(json.dumps(results, indent=1))
