"""Running a project Triton kernel on the CPU, through Triton's interpreter.

TRITON_INTERPRET=1 must be set before triton is first imported (Triton's own jit functions are
made for the interpreter then), so the kernel's checks run in a process of their own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def patch_interpreter() -> None:
    """The interpreter's scalars are 1-element arrays, which numpy 2.4 no longer turns into
    Python ints: give its tensors an __index__. Call first in the interpreter's process."""
    import triton.runtime.interpreter as interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def run_interpreted(module: str, function: str) -> subprocess.CompletedProcess:
    """`module.function()` in a new process under the interpreter; its output captured."""
    return subprocess.run(
        [sys.executable, "-c", f"import {module} as m; m.{function}()"], cwd=ROOT,
        capture_output=True, text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
