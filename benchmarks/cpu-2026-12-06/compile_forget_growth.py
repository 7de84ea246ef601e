"""Forget, load and compile again, N times, on the CPU: the demo model's paged decode step
(runner.BatchRunner at 1, 2 and 4 rows) through the engine's shared inductor backend
(cuda_graphs.compile_forward), then compiled_code.forget_compiled_code; prints the live
FrameSummary / StackSummary / guard-manager / list / dict counts after each forget. A check of
whether what dynamo built piles up across forgets off the GPU (it did on an H100, BENCHMARKS.md
"Switching modes"). Add "dyn" for torch's automatic dynamic shapes (the row count symbolic from
the second shape, as the engine compiles rows 2 and up with --compiled-rows above 1).

    python benchmarks/cpu-2026-12-06/compile_forget_growth.py 8
"""

import collections
import gc
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "model_utils")]

from test_compiled_code import load  # noqa: E402 - the demo model, weights moved by a seed

from model_utils.runtime import compiled_code  # noqa: E402
from model_utils.runtime.cuda_graphs import compile_forward  # noqa: E402
from model_utils.runtime.runner import BatchRunner  # noqa: E402


class Step:
    def __init__(self, model, dynamic):
        self.forward = compile_forward(model, "default", dynamic=dynamic)

    def __call__(self, kv, b):
        kv.prepare_decode(b)
        return self.forward(**kv.decode_args(b)).logits[:, -1]


def counts() -> dict:
    gc.collect()
    live = collections.Counter(type(o).__name__ for o in gc.get_objects())
    return {k: live[k] for k in ("FrameSummary", "StackSummary", "CheckFunctionManager", "list",
                                 "dict")}


dynamic = None if "dyn" in sys.argv else False
compiled_code.forget_compiled_code()
for cycle in range(int(sys.argv[1])):
    model = load(cycle)
    runner = BatchRunner(model, context_tokens=64, max_batch=4, step_fn=Step(model, dynamic),
                         kv_tokens=256)
    runner.warm_up((1, 2, 4))
    del runner, model
    compiled_code.forget_compiled_code()
    print(cycle, counts(), flush=True)
