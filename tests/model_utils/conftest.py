"""Shared fixtures for the engine tests: the demo model, one engine, a fresh demo tokenizer.

Everything runs on the CPU against the embedded demo model (a tiny random Qwen3 built into
~/.cache/qwen-chat on first use, or $QWEN_CHAT_CACHE), through the same from_pretrained path a
real checkpoint takes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from model_utils.engine import Engine
from model_utils.loading.demo_model import demo_model_path

from .helpers import cpu_request


@pytest.fixture(scope="session")
def demo_path() -> Path:
    return demo_model_path()


@pytest.fixture(scope="session")
def engine(demo_path):
    """One engine for the tests that only need "some demo model loaded" (see load_demo)."""
    engine = Engine()
    yield engine
    engine.unload()


@pytest.fixture
def load_demo(engine):
    """load_demo(mode, **request_fields) -> the session engine with that exact request loaded.

    Loads only when the loaded request differs, so tests that agree on a mode share one load.
    """

    def load(mode: str = "fp32", **kwargs) -> Engine:
        request = cpu_request(mode, **kwargs)
        loaded = engine.manager.loaded
        if loaded is None or loaded.request != request:
            engine.load(request)
        return engine

    return load


@pytest.fixture
def demo_tokenizer(demo_path):
    """A fresh copy of the demo tokenizer (tests may change its chat_template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_path)
