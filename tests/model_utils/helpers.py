"""Constants and helpers shared by the engine tests (fixtures live in conftest.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

from model_utils.loading.loaded_model import LoadRequest
from model_utils.loading.placement import Placement
from model_utils.runtime.generation_settings import GenerationSettings

REPO_ROOT = Path(__file__).resolve().parents[2]
# Files the tests compare against, kept in the repository (tests/fixtures/README.md says what).
FIXTURES = REPO_ROOT / "tests" / "fixtures"

CPU = Placement("cpu")
# A few greedy tokens, EOS masked so that every reply has exactly max_new_tokens tokens.
FEW_TOKENS = GenerationSettings(max_new_tokens=4, min_new_tokens=4, temperature=0.0)
HELLO = [{"role": "user", "content": "Hello, how are you today?"}]


def cpu_request(mode: str = "fp32", model: str = "demo", **kwargs) -> LoadRequest:
    return LoadRequest(model=model, mode=mode, placement=CPU, **kwargs)



def copy_demo(demo_path: Path, target: Path, *, weights: bool = True) -> Path:
    """A copy of the demo checkpoint's files in `target` (a folder under an allowed root)."""
    target.mkdir(parents=True)
    for item in demo_path.iterdir():
        if item.is_file() and (weights or item.suffix != ".safetensors"):
            shutil.copy2(item, target / item.name)
    return target


def copy_demo_with_other_shapes(demo_path: Path, target: Path) -> Path:
    """A copy of the demo checkpoint whose weights read (every header is sound) but whose
    first MLP down-projection is one column wider than the config says: it passes every check
    made before a switch and fails in the load itself, the case a switch restores from."""
    import torch
    from safetensors.torch import load_file, save_file

    copy_demo(demo_path, target, weights=False)
    weights = load_file(demo_path / "model.safetensors")
    name = next(n for n in sorted(weights) if n.endswith("mlp.down_proj.weight"))
    rows, columns = weights[name].shape
    weights[name] = torch.zeros(rows, columns + 1, dtype=weights[name].dtype)
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target


def prefill_logits(engine, tokens: list[int], chunk: int):
    """Logits of the last of `tokens`, prefilled through the engine's batch runner into blocks
    taken for it (and given back), `chunk` tokens per forward."""
    import torch

    runner = engine.serving.scheduler.runner

    def run():
        pool = runner.blocks()
        blocks = pool.allocate(-(-len(tokens) // pool.block_size))
        try:
            with torch.inference_mode():
                return runner.forward_prompt(tokens, blocks, chunk=chunk)
        finally:
            pool.release(blocks)

    return engine.worker.call(run)


def record_padded_prefills(runner) -> list[list[int]]:
    """The prompt lengths of each call of the runner's padded prefill from now on (its class
    swapped for one that records; `runner.padded_prefill = None` ends it)."""
    padded = runner.padded_prefill
    calls: list[list[int]] = []
    original = padded.__call__

    class Recording(type(padded)):
        def __call__(self, prompts, blocks):
            calls.append([len(p) for p in prompts])
            return original(prompts, blocks)

    padded.__class__ = Recording
    return calls


def submitted_together(engine, jobs: list, timeout: float = 120) -> list:
    """Each of `jobs` (a submit to the engine's scheduler) from its own thread, all waiting in
    the queue at once before the decode worker takes any; their results in order."""
    import threading
    import time

    gate = threading.Event()
    results: list = [None] * len(jobs)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, jobs[i]()))
               for i in range(len(jobs))]
    try:
        engine.worker.post(gate.wait)  # the decode worker is busy while they arrive
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        while engine.serving.scheduler.load()["waiting"] < len(jobs):
            assert time.monotonic() < deadline, "the requests never all waited"
            time.sleep(0.02)
    finally:
        gate.set()  # a failed check must not leave the worker blocked for the next tests
    for t in threads:
        t.join(timeout=300)
    return results
