"""Where torch.compile keeps what it compiled, so that a mode compiled once loads warm later.

Most of a GPU switch's wait is compiling, not reading weights (BENCHMARKS.md, "Switching
modes"). Inductor already caches its output: compiled FX graphs, AOTAutograd's graphs,
autotuning results and Triton's kernels (under <cache>/triton). Two things keep that from
helping a user: the cache lives in the system's temp folder by default (emptied at reboot, and
on many hosts by a timer), and a torch release may change the defaults. So a serving process
with a CUDA GPU (the app compiles nothing without one) points the cache at a folder beside the
app's other data (`use_compile_cache`, called by process_tuning.tune_process with the app's
--compile-cache) and turns the caches on by name.

What a hit needs is inductor's own key: the traced graph (so the model's code, its shapes and
the mode's layers), the input shapes, dtypes and strides, the inductor settings, and the torch,
Triton and CUDA versions with the GPU. A changed model architecture, mode, torch or transformers
version (which changes the traced code) misses and compiles afresh; weights are graph inputs,
not constants, so a model of the same shape with other weights hits.

`counts()` reads inductor's hit and miss counters, so a load can say whether it was warm.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "TORCHINDUCTOR_CACHE_DIR"
APP_CACHE_ENV = "QWEN_CHAT_CACHE"  # where the app keeps its data (loading/demo_model.py)


def default_dir() -> Path:
    """The folder the app uses unless told otherwise: $TORCHINDUCTOR_CACHE_DIR when the user
    set it, else torch-compile beside the app's other data (the demo model, trained models,
    the chat store): in $QWEN_CHAT_CACHE when set, else in ~/.cache/qwen-chat, as they are."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    app_cache = os.environ.get(APP_CACHE_ENV) or Path.home() / ".cache" / "qwen-chat"
    return Path(app_cache) / "torch-compile"


def use_compile_cache(directory: str | Path) -> Path:
    """Make `directory` inductor's cache for this process (created if missing) and turn its
    graph caches on. Read by torch at each compile: call it before the first one."""
    folder = Path(directory).expanduser().resolve()
    folder.mkdir(parents=True, exist_ok=True)
    os.environ[ENV] = str(folder)
    import torch._functorch.config
    import torch._inductor.config

    torch._inductor.config.fx_graph_cache = True
    torch._inductor.config.autotune_local_cache = True
    torch._functorch.config.enable_autograd_cache = True
    return folder


def counts() -> dict[str, int]:
    """Compiled graphs found in the cache (hits) and compiled afresh (misses) so far in this
    process. A load compares them before and after its compile."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return {"hits": int(inductor["fxgraph_cache_hit"]), "misses": int(inductor["fxgraph_cache_miss"])}


def since(before: dict[str, int]) -> dict[str, int]:
    now = counts()
    return {key: now[key] - before.get(key, 0) for key in now}
