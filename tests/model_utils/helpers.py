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
