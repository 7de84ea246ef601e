"""Crafted adapter folders (hostile adapter_config.json or weights) are refused with a plain
message before the model that serves is touched, and the model list still reads."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from model_utils.errors import LoadError
from model_utils.training.manifest import MANIFEST, MANIFEST_FORMAT

from .helpers import cpu_request

EXCEPTION = re.compile(r"\b[A-Z][A-Za-z]*(Error|Exception)\b|Traceback|weights_only")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, demo_path):
    """A models folder with a real (untrained) LoRA adapter on the demo model, and copies of
    it made hostile one way each."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("models")
    good = root / "good"
    base = AutoModelForCausalLM.from_pretrained(demo_path, dtype=torch.float32)
    get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])) \
        .save_pretrained(good)
    for file in demo_path.iterdir():
        if "token" in file.name or file.suffix == ".jinja":
            shutil.copy(file, good / file.name)
    (good / MANIFEST).write_text(json.dumps({"format": MANIFEST_FORMAT, "base_model": "demo",
                                             "method": "lora"}))
    config = json.loads((good / "adapter_config.json").read_text())

    def variant(name, *, config_text=None, weights=None, files=None, drop=()):
        folder = root / name
        shutil.copytree(good, folder)
        if config_text is not None:
            (folder / "adapter_config.json").write_text(config_text)
        if weights is not None:
            (folder / "adapter_model.safetensors").write_bytes(weights)
        for file in drop:
            (folder / file).unlink()
        for file, content in (files or {}).items():
            (folder / file).write_bytes(content)

    variant("nested-config", config_text="[" * 100_000 + "]" * 100_000)
    variant("config-not-json", config_text="{nope")
    variant("config-a-list", config_text="[]")
    variant("rank-a-string", config_text=json.dumps({**config, "r": "x"}))
    variant("targets-a-number", config_text=json.dumps({**config, "target_modules": 5}))
    variant("unknown-type", config_text=json.dumps({**config, "peft_type": "<b>X</b>"}))
    variant("rank-8-weights-4", config_text=json.dumps({**config, "r": 8}))
    variant("targets-elsewhere", config_text=json.dumps({**config,
                                                         "target_modules": ["nowhere"]}))
    variant("garbage-weights", weights=b"\xff" * 100)
    variant("pickle-weights", drop=["adapter_model.safetensors"],
            files={"adapter_model.bin": b"\x80\x04not a pickle"})
    variant("nested-manifest", files={MANIFEST: b"[" * 100_000 + b"]" * 100_000})
    variant("manifest-base-a-list", files={MANIFEST: json.dumps(
        {"format": MANIFEST_FORMAT, "base_model": "x", "base_path": [1]}).encode()})
    return root


CRAFTED = [
    ("nested-config", "adapter_config.json is not valid JSON"),
    ("config-not-json", "adapter_config.json is not valid JSON"),
    ("config-a-list", "must hold a JSON object"),
    ("rank-a-string", "r in adapter_config.json must be a whole number"),
    ("targets-a-number", "target_modules in adapter_config.json must be a module name"),
    ("unknown-type", "only LoRA adapters are loaded"),
    ("rank-8-weights-4", "its weights are of rank 4, its adapter_config.json says r=8"),
    ("targets-elsewhere", "does not fit its base model"),
    ("garbage-weights", "adapter_model.safetensors is not a readable safetensors file"),
    ("pickle-weights", "has no adapter_model.safetensors"),
    ("manifest-base-a-list", "names no base model folder"),
]


@pytest.mark.parametrize(("name", "words"), CRAFTED, ids=[c[0] for c in CRAFTED])
def test_a_crafted_adapter_is_refused_plainly_and_the_model_keeps_serving(
        load_demo, adapters, name, words):
    engine = load_demo("fp32")
    engine.registry.allow_root(adapters)
    serving = engine.manager.loaded
    with pytest.raises(LoadError) as refused:
        engine.load(cpu_request("fp32", model=str(adapters / name)))
    message = str(refused.value)
    assert words in message, message
    assert not EXCEPTION.search(message), message
    assert str(adapters) not in message
    if name != "targets-elsewhere":  # refused before the unload: not even loaded again
        assert engine.manager.loaded is serving


def test_the_model_list_reads_past_crafted_manifests_and_the_good_adapter_loads(
        load_demo, adapters):
    engine = load_demo("fp32")
    engine.registry.allow_root(adapters)
    from model_utils.loading.registry import ModelRegistry

    labels = [label for label, _ in ModelRegistry(adapters).choices()]
    assert any(label.startswith("good (lora adapter on demo)") for label in labels), labels
    status = engine.load(cpu_request("fp32", model=str(adapters / "good")))
    assert status["loaded"]
