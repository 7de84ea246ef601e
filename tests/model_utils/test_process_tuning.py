"""The engine changes nothing process-wide by being imported, constructed or loading a model;
app.py's one call, process_tuning.tune_process(), is what does (GC freezing after loads, the
allocator threshold, the bitsandbytes warning filter)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

SCRIPT = r"""
import gc, warnings
def ours():  # the filter tune_process adds (libraries add their own at import)
    return sum(1 for f in warnings.filters if f[1] is not None and "MatMul8bitLt" in f[1].pattern)
from model_utils.engine import Engine
from model_utils.loading.manager import LoadRequest
from model_utils.loading.placement import Placement
from model_utils import process_tuning

engine = Engine()
engine.load(LoadRequest(model="demo", mode="fp32", placement=Placement("cpu")))
print("untuned", gc.get_freeze_count(), ours())
engine.unload()
process_tuning.tune_process()
engine.load(LoadRequest(model="demo", mode="fp32", placement=Placement("cpu")))
print("tuned", gc.get_freeze_count(), ours())
"""


def test_only_the_explicit_call_tunes_the_process(demo_path):
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    frozen, filters = map(int, lines["untuned"].split())
    assert (frozen, filters) == (0, 0), "constructing/loading the engine tuned the process"
    frozen, filters = map(int, lines["tuned"].split())
    assert frozen > 10_000 and filters == 1
