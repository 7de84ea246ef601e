"""The switch chain of test_switching, run in a process of its own.

Usage: python -m tests.model_utils.switch_chain MODELS_DIR [WARM_UP CHAIN]  (prints one JSON
object; WARM_UP and CHAIN: modes separated by commas, by default those below)

RSS is a reading of the whole process: in a shared test process, threads that earlier tests
left behind (servers, thread pools) allocate while the chain runs, and a full run read up to
15 MB more than the chain itself held. A process of its own reads only the chain.
"""

from __future__ import annotations

import json
import sys
import weakref
from pathlib import Path

from model_utils import process_tuning
from model_utils.engine import Engine
from model_utils.memory import GB

from .helpers import FEW_TOKENS, HELLO, cpu_request

CHAIN = ("fp32", "int8", "nf4", "bf16", "fp32")
WARM_UP = ("int8", "nf4", "bf16")


def run_chain(models_dir: Path, warm_up=WARM_UP, chain=CHAIN) -> dict:
    # The app tunes its process (glibc's mmap threshold pinned, which is what makes RSS drop
    # after an unload); the chain runs in a process tuned the same way.
    process_tuning.tune_process()
    engine = Engine(models_dir=models_dir)
    # Warm-up: the first int8 / 4-bit / bf16 matmul on a CPU loads bitsandbytes' kernels and
    # torch's bf16 code paths once for the life of the process, and the kernels chosen for
    # each shape are kept; that is not memory a switch should give back, so it is paid before
    # the chain, on the model the chain switches.
    for mode in warm_up:
        engine.load(cpu_request(mode, model="wide"))
        engine.generate_text(HELLO, FEW_TOKENS)
    engine.unload()
    warmed_up = engine.manager.last_unload.after["rss_gb"] * GB

    unloads, problems = [], []
    previous = None  # weak reference to the model the next switch must free
    for mode in chain:
        footprint = engine.manager.loaded.footprint_gb if engine.manager.loaded else 0.0
        status = engine.load(cpu_request(mode, model="wide"))
        if (status["mode"], status["placement"]) != (mode, "cpu"):
            problems.append(f"loaded {status['mode']} on {status['placement']}, not {mode} on cpu")
        if engine.generate_text(HELLO, FEW_TOKENS).stats.new_tokens != 4:
            problems.append(f"{mode} did not answer with 4 tokens")
        if previous is not None:
            if previous() is not None:
                problems.append(f"the model before {mode} is still alive after the switch")
            unloads.append(_reading(engine.manager.last_unload, footprint))
        previous = weakref.ref(engine.manager.loaded.model)

    footprint = engine.manager.loaded.footprint_gb
    engine.unload()
    if previous() is not None:
        problems.append("the last model is still alive after the unload")
    unloads.append(_reading(engine.manager.last_unload, footprint))
    return {"warmed_up_rss": warmed_up, "unloads": unloads, "problems": problems}


def _reading(report, footprint_gb: float) -> dict:
    """An unload's RSS before and after (bytes), read by the unload after its collection."""
    return {"model": report.model, "footprint": footprint_gb * GB,
            "rss_before": report.before["rss_gb"] * GB, "rss_after": report.after["rss_gb"] * GB}


if __name__ == "__main__":
    modes = [tuple(arg.split(",")) for arg in sys.argv[2:4]]
    print(json.dumps(run_chain(Path(sys.argv[1]), *modes)))
