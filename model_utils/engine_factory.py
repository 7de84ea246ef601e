"""The engine an EngineConfig describes: the one place that picks the in-process engine or the
tensor-parallel one (imports torch), so that the config itself imports nothing above it."""

from __future__ import annotations

from .engine_config import EngineConfig


def build_engine(config: EngineConfig, **extra):
    """The engine for `config`, given the config whole. `extra`: the engine's other keyword
    arguments (cache_dir, busy_timeout_s). With tp > 1, the tensor-parallel engine."""
    if config.tp > 1:
        from .parallel.engine import TensorParallelEngine

        return TensorParallelEngine(config, **extra)
    from .engine import Engine

    return Engine(config, **extra)
