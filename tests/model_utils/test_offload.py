"""Offloading for real on a machine without a GPU: accelerate's strategies place the model over
the CPU under a cap and put what does not fit into an offload folder on disk."""

from __future__ import annotations

import pytest

from model_utils.engine import Engine
from model_utils.errors import LoadError
from model_utils.loading.loaded_model import LoadRequest
from model_utils.loading.placement import Placement
from model_utils.runtime.generation_settings import GenerationSettings

GREEDY = GenerationSettings(max_new_tokens=6, temperature=0.0)
HELLO = [{"role": "user", "content": "Hello"}]


def test_disk_offload_loads_and_answers(tmp_path):
    engine = Engine(models_dir=tmp_path)
    offload = tmp_path / "offload"
    status = engine.load(LoadRequest("demo", "fp32", Placement(
        "sequential", max_memory_gb={"cpu": 0.0001}, offload_folder=str(offload))))
    assert "disk" in status["device_map"], status["device_map"]
    assert "offloaded to the CPU and disk" not in status["estimate"]  # no GPU to spill from
    assert "offloaded to the disk" in status["estimate"]
    assert status["decode_path"] == "eager"
    offloaded = engine.generate_text(HELLO, GREEDY)
    engine.load(LoadRequest("demo", "fp32", Placement("cpu")))
    assert engine.generate_text(HELLO, GREEDY).answer == offloaded.answer  # same weights


def test_offload_folder_outside_the_allowed_roots_is_refused(tmp_path):
    engine = Engine(models_dir=tmp_path / "models")
    with pytest.raises(LoadError, match="offload folder .* is outside the allowed"):
        engine.load(LoadRequest("demo", "fp32", Placement(
            "sequential", max_memory_gb={"cpu": 0.0001},
            offload_folder=str(tmp_path / "elsewhere"))))
