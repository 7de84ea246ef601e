"""The bench with lm_head quantized too in the 8-bit modes (the app keeps it in the compute
dtype): `python benchmarks/cpu-2026-12-04/int8_head_quality.py --model /tmp/peaked256 --modes
int8-wo --batch 1 --prompt-tokens 32 --new-tokens 8 --match-prompts 1 --no-logprobs
--quality-positions 384 --out quality-int8-wo-head-in-int8.json`, from the repository root."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model_utils.layers import weight_only  # noqa: E402

original = weight_only.quantizable


def with_head(name, linear, bits, group, fmt="int"):
    if name.split(".")[-1] == "lm_head" and bits == 8:
        return fmt != "fp8" or weight_only.fp8_weights.fits(linear)
    return original(name, linear, bits, group, fmt)


weight_only.quantizable = with_head

from model_utils.bench.run import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
