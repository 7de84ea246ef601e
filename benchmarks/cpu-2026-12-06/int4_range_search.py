"""int4-wo's KL against fp32 with each group's range searched among clippings of its min-max
(int_quantization.INT4_RANGE_FRACTIONS) and without (min-max only), in groups of 128 (the mode's)
and of 64, beside nf4's, on peaked models (model_utils.bench.peaked_model). One bench process
per variant:

    python benchmarks/cpu-2026-12-06/int4_range_search.py /tmp/peaked400 /tmp/peaked256 > out.json
"""

import json
import subprocess
import sys

VARIANT = """
import dataclasses
import model_utils.layers.int_quantization as wo
from model_utils.loading import modes
modes.MODES["int4-wo"] = dataclasses.replace(modes.MODES["int4-wo"], group_size={group})
wo.INT4_RANGE_FRACTIONS = {fractions}
from model_utils.bench.run import main
main(["--model", {model!r}, "--modes", "fp32,int4-wo,nf4", "--batch", "1",
      "--prompt-tokens", "32", "--new-tokens", "8", "--match-prompts", "1", "--no-logprobs",
      "--quality-positions", "384", "--out", "/tmp/int4-range-search.json"])
"""
FRACTIONS = [(1.0,), (1.0, 0.9, 0.85, 0.8), (1.0, 0.95, 0.9, 0.85, 0.8)]

results = []
for model in sys.argv[1:]:
    for group, fractions in [(g, f) for g in (128, 64) for f in FRACTIONS]:
        code = VARIANT.format(fractions=fractions, model=model, group=group)
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
        rows = json.load(open("/tmp/int4-range-search.json"))["rows"]
        results.append({"model": model, "group": group, "fractions": fractions,
                        **{r["mode"]: {"kl": r["kl_vs_fp32"], "top1": r["top1_vs_fp32"]}
                           for r in rows if r["mode"] != "fp32"}})
        print(json.dumps(results[-1]), file=sys.stderr)
print(json.dumps(results, indent=1))
