"""Compile a four-layer module (torch.compile, backend "eager"), call it, forget what was
compiled (compiled_code.forget_compiled_code), three times; after each forget print how many
stack summaries are alive and how many of them only C++ holds (the stacks dynamo's guards keep:
held from C++ alone after a forget, they belong to guards of forgotten code). "fixed" first
installs what each load of the app installs before compiling (compiled_code's
_build_no_diff_guards: no diff-guard copies of the guard trees).

    python benchmarks/cpu-2026-12-07/guard_stacks_after_forget.py [fixed]
"""

import gc
import sys
import traceback
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from model_utils.runtime import compiled_code  # noqa: E402


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def stacks() -> tuple[int, int]:
    gc.collect()
    summaries = [o for o in gc.get_objects() if type(o) is traceback.StackSummary]
    alone = sum(all(r is summaries or isinstance(r, types.FrameType)
                    for r in gc.get_referrers(summary)) for summary in summaries)
    return len(summaries), alone


if "fixed" in sys.argv:
    compiled_code._build_no_diff_guards()
print("torch", torch.__version__, "fixed" if "fixed" in sys.argv else "as torch builds them")
for cycle in range(3):
    model = Stack()
    step = torch.compile(model.forward, backend="eager")
    step(torch.ones(2, 8))
    print(cycle, "before the forget: stack summaries, held by C++ alone", stacks())
    del step, model
    compiled_code.forget_compiled_code()
    print(cycle, "after the forget: stack summaries, held by C++ alone", stacks(), flush=True)
