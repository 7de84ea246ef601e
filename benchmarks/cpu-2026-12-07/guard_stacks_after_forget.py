"""Compile a four-layer module (torch.compile, backend "eager"), call it, forget what was
compiled (compiled_code.forget_compiled_code), three times; after each forget print how many
stack summaries are alive and how many of them only C++ holds (the stacks dynamo's guards keep:
held from C++ alone after a forget, they belong to guards of forgotten code). "fixed" first
installs what each load of the app installs before compiling (compiled_code's
_build_no_diff_guards: no diff-guard copies of the guard trees).

    python benchmarks/cpu-2026-12-07/guard_stacks_after_forget.py [fixed]
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "model_utils")]

import torch  # noqa: E402
from test_compiled_code import LinearStack, stack_summaries  # noqa: E402

from model_utils.runtime import compiled_code  # noqa: E402

if "fixed" in sys.argv:
    compiled_code._build_no_diff_guards()
print("torch", torch.__version__, "fixed" if "fixed" in sys.argv else "as torch builds them")
for cycle in range(3):
    model = LinearStack()
    step = torch.compile(model.forward, backend="eager")
    step(torch.ones(2, 8))
    print(cycle, "before the forget: stack summaries, held by C++ alone", stack_summaries())
    del step, model
    compiled_code.forget_compiled_code()
    print(cycle, "after the forget: stack summaries, held by C++ alone", stack_summaries(),
          flush=True)
