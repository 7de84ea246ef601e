"""The demo model loaded in bf16, int4-wo and int8-wo on the CPU, one after another, N cycles,
each load's paged decode step compiled (cuda_graphs.compile_forward, torch's automatic dynamic
row count, warmed at 1, 2 and 4 rows) as the engine does, with two kinds of compiled code kept
(compiled_code.KEPT_KINDS = 2: most loads forget the code compiled before); after each cycle the
live counts of dynamo's stack summaries and some other kinds. The GPU switching-memory test's
growth, off the GPU. "unfixed" leaves out compiled_code._build_no_diff_guards.

    python benchmarks/cpu-2026-12-07/switch_kinds_guard_growth.py 3 [unfixed]
"""

import collections
import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from model_utils.layers.weight_only import load_quantized  # noqa: E402
from model_utils.loading.demo_model import demo_model_path  # noqa: E402
from model_utils.runtime import compiled_code  # noqa: E402
from model_utils.runtime.cuda_graphs import compile_forward  # noqa: E402
from model_utils.runtime.runner import BatchRunner  # noqa: E402

compiled_code.KEPT_KINDS = 2
if "unfixed" in sys.argv:
    compiled_code._build_no_diff_guards = lambda: None


class Step:
    def __init__(self, model):
        self.forward = compile_forward(model, "default", dynamic=None)

    def __call__(self, kv, b):
        kv.prepare_decode(b)
        return self.forward(**kv.decode_args(b)).logits[:, -1]


def load(mode: str) -> torch.nn.Module:
    if mode == "bf16":
        return AutoModelForCausalLM.from_pretrained(demo_model_path(), dtype=torch.bfloat16)
    bits = 4 if mode == "int4-wo" else 8
    return load_quantized(demo_model_path(), bits, 32 if bits == 4 else None,
                          device_map={"": "cpu"}, dtype=torch.bfloat16)


def counts() -> dict:
    gc.collect()
    live = collections.Counter(type(o).__name__ for o in gc.get_objects())
    return {k: live[k] for k in ("FrameSummary", "StackSummary", "list", "function",
                                 "GuardManagerWrapper")}


print("torch", torch.__version__, "unfixed" if "unfixed" in sys.argv else "", flush=True)
compiled_code.forget_compiled_code()
for cycle in range(int(sys.argv[1])):
    for mode in ("bf16", "int4-wo", "int8-wo"):
        compiled_code.reuse_or_make_room(mode)
        model = load(mode)
        runner = BatchRunner(model, context_tokens=64, max_batch=4, step_fn=Step(model),
                             kv_tokens=256)
        with torch.inference_mode():
            runner.warm_up((1, 2, 4))
        del runner, model
    print(cycle, counts(), flush=True)
