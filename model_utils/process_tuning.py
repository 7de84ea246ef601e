"""Process-wide settings for a process that serves one engine for a long time (app.py, the CLI).

Importing or constructing the engine changes nothing outside it; a program that hosts the
engine opts in with one call, `tune_process()`, which:

- pins glibc's mmap threshold (memory_accounting.pin_mmap_threshold), so that an unloaded
  model's weights leave the process's RSS instead of staying in the heap;
- freezes the objects alive after each model load (and after `serving_started()`, the web
  server's) out of the garbage collector's full passes, which otherwise pause every thread,
  the decode loop's included, for a scan of ~500 000 long-lived objects
  (memory_accounting.freeze_long_lived has the measurement);
- silences bitsandbytes' per-call warning that int8 matmul inputs are cast: the app picks the
  dtypes on purpose, and the warning would fill the log on every decode step;
- keeps library chatter off the console: bitsandbytes' notice on CPUs with AVX-512 BF16 that
  its hub kernel could not be fetched ("No module named 'kernels'"; it falls back to its own
  CPU path, and the app works offline), and transformers' "Loading weights" bars (the app logs
  each load's stages itself);
- keeps torch.compile's caches in a folder that outlives the process and the machine's temp
  folder (runtime/compile_cache.py), so that a mode compiled once loads warm in a later run
  (on a machine with a CUDA GPU: without one the app compiles nothing).

A library user (a notebook, a test) that does not call it gets the engine with none of these.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

_tuned = False
log = logging.getLogger(__name__)


def tune_process(compile_cache: str | Path | None = None) -> None:
    """`compile_cache`: the folder for torch.compile's caches (None: compile_cache.default_dir(),
    "off": torch's own default, in the temp folder); not used without a CUDA GPU."""
    global _tuned
    from .loading.memory_accounting import pin_mmap_threshold
    from .runtime import compile_cache as cache

    pin_mmap_threshold()
    if str(compile_cache) != "off" and _compiles_here():
        folder = compile_cache or cache.default_dir()
        try:
            cache.use_compile_cache(folder)
        except OSError as error:  # a slower first compile is no reason to refuse to serve
            log.warning("cannot keep torch.compile's cache in %s (%s): using torch's default, "
                        "in the temp folder", folder, error.strerror or error)
    warnings.filterwarnings("ignore", message="MatMul8bitLt: inputs will be cast")
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    _tuned = True


def _compiles_here() -> bool:
    """Whether the app may compile in this process: its decode step is compiled on a CUDA GPU
    only. Without one the compile cache is left alone, not pointed anywhere: torch makes the
    folder it names as soon as torch._dynamo is imported, and an empty folder the app never
    uses would be left in the user's cache."""
    import torch

    return torch.cuda.is_available()


def model_loaded() -> None:
    """Called by the manager after each load: freeze what is alive now, if tuned."""
    if _tuned:
        from .loading.memory_accounting import freeze_long_lived

        freeze_long_lived()


def serving_started() -> None:
    """Called by app.py once the web server is up: its objects are long-lived too."""
    model_loaded()
