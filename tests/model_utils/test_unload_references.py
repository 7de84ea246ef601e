"""An unload lets go of everything the load made: the model, each of its modules, parameters
and buffers, the tokenizer, and what serving built around them (scheduler, runner, KV cache);
and a failed switch leaves no second model alive, not even while its error is held.

Memory counters cannot prove this on the demo model (a few MB, under the allocator's noise);
weak references can: a dead weak reference is an object nothing keeps."""

from __future__ import annotations

import gc
import json
import shutil
import threading
import weakref

import pytest

from model_utils.engine import Engine
from model_utils.errors import LoadError
from model_utils.training.manifest import MANIFEST, MANIFEST_FORMAT

from .helpers import FEW_TOKENS, HELLO, cpu_request

# Every mode that loads on a CPU, bitsandbytes' and the app's own weight-only layers included:
# each builds its weights its own way (quantize as it loads, quantization statistics beside
# the weight), and each of those ways could keep a reference.
CPU_MODES = ("fp32", "bf16", "int8", "nf4", "int8-wo", "int4-wo", "fp8")


def references_of(engine: Engine) -> dict[str, weakref.ref]:
    """Weak references to everything the current load made, by name."""
    loaded, serving = engine.manager.loaded, engine.serving
    refs = {"model": weakref.ref(loaded.model), "tokenizer": weakref.ref(loaded.tokenizer),
            "loaded model": weakref.ref(loaded), "serving": weakref.ref(serving)}
    for name, module in loaded.model.named_modules():
        refs[f"module {name or '(root)'}"] = weakref.ref(module)
    for name, tensor in [*loaded.model.named_parameters(), *loaded.model.named_buffers()]:
        refs[f"tensor {name}"] = weakref.ref(tensor)
    if engine._grammar_cache is not None:
        refs["grammar compiler"] = weakref.ref(engine._grammar_cache[1])
    if serving.scheduler is not None:
        runner = serving.scheduler.runner
        refs.update({"scheduler": weakref.ref(serving.scheduler), "runner": weakref.ref(runner),
                     "kv cache": weakref.ref(runner.kv)})
        for i, pool in enumerate(runner.kv.keys):
            refs[f"key pool {i}"] = weakref.ref(pool)
    return refs


def alive(refs: dict[str, weakref.ref]) -> list[str]:
    gc.collect()
    return [name for name, ref in refs.items() if ref() is not None]


def live_models(cls: type) -> list:
    """Every model object of this class alive in this process (whoever loaded it)."""
    # What a tuned process froze after a load (process_tuning) is out of get_objects' sight.
    gc.unfreeze()
    gc.collect()
    # type(o), not isinstance: a deprecated module attribute's own __class__ warns
    return [o for o in gc.get_objects() if issubclass(type(o), cls)]


def replies_together(engine: Engine, n: int = 3) -> None:
    """n replies at once, so that the batch path (rows, blocks, the scheduler's loop) ran,
    and one forced into JSON (the grammar compiler, which holds the tokenizer)."""
    from model_utils.runtime.grammar import OutputFormat

    threads = [threading.Thread(target=engine.generate_text, args=(HELLO, FEW_TOKENS))
               for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine.generate_text(HELLO, FEW_TOKENS, output_format=OutputFormat("json_object"))


@pytest.mark.parametrize("mode", CPU_MODES)
def test_an_unload_drops_every_reference_the_load_made(mode):
    engine = Engine(max_batch=4)
    engine.load(cpu_request(mode))
    replies_together(engine)
    refs = references_of(engine)
    assert len(refs) > 50  # the demo model's modules and tensors are all in it
    engine.unload()
    assert engine.manager.last_unload.model_kept_by == []
    assert alive(refs) == []


def test_a_switch_drops_every_reference_of_the_mode_it_replaced():
    engine = Engine(max_batch=4)
    engine.load(cpu_request("fp32"))
    replies_together(engine)
    refs = references_of(engine)
    tokenizer = engine.manager.loaded.tokenizer
    engine.load(cpu_request("int8-wo"))
    # The tokenizer is the one thing a mode switch keeps (tokenizer_reuse): it serves on.
    assert engine.manager.loaded.tokenizer is tokenizer
    refs.pop("tokenizer")
    refs.pop("grammar compiler")  # made of the tokenizer: kept with it
    del tokenizer
    assert alive(refs) == []


@pytest.fixture
def failing_adapter(tmp_path, demo_path):
    """An adapter folder that passes every check made before the unload, and fails only once
    the base model is loaded: its weights name layers the model does not have."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "models" / "elsewhere"
    base = AutoModelForCausalLM.from_pretrained(demo_path, dtype=torch.float32)
    get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(folder)
    del base
    for file in demo_path.iterdir():  # an adapter folder carries its tokenizer
        if "token" in file.name or file.suffix == ".jinja":
            shutil.copy(file, folder / file.name)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config,
                                                            "target_modules": ["nowhere"]}))
    (folder / MANIFEST).write_text(json.dumps({"format": MANIFEST_FORMAT, "base_model": "demo",
                                               "method": "lora"}))
    return folder


def test_a_failed_switch_leaves_only_the_restored_model_alive(failing_adapter):
    engine = Engine(max_batch=4)
    engine.registry.allow_root(failing_adapter)
    engine.load(cpu_request("fp32"))
    replies_together(engine)
    refs = references_of(engine)
    refs.pop("tokenizer")  # kept by the switch, and by the restored model after it
    refs.pop("grammar compiler")  # likewise
    model_class = type(engine.manager.loaded.model)
    models_before = len(live_models(model_class))  # this engine's, and other tests' alive

    with pytest.raises(LoadError, match="serving again") as caught:
        engine.load(cpu_request("fp32", model=str(failing_adapter)))
    # While the caller still holds the error (a log handler, the page's message): the model
    # the switch unloaded, and the base model the adapter failed on, are both gone; only
    # the restored one is alive.
    assert caught.value is not None
    assert alive(refs) == []
    assert len(live_models(model_class)) == models_before
    assert engine.generate_text(HELLO, FEW_TOKENS).stats.new_tokens == 4

    restored = references_of(engine)
    engine.unload()
    assert alive(restored) == []
    assert len(live_models(model_class)) == models_before - 1


class PreparationFails(RuntimeError):
    pass


def test_a_model_its_preparation_failed_on_is_not_kept(demo_path):
    """The manager with a preparation (its on_loaded hook) that fails on the second load, as a
    CUDA-graph capture out of memory would: that model is dropped before the restore, and a
    first load that fails the same way leaves nothing loaded."""
    from model_utils.loading.manager import ModelManager
    from model_utils.loading.registry import ModelRegistry

    manager = ModelManager(ModelRegistry())
    prepared, unloaded = [], []

    def prepare(loaded, _progress):
        prepared.append(weakref.ref(loaded.model))
        if len(prepared) == 2:
            raise PreparationFails("capturing the decode step: out of memory")

    manager.on_loaded, manager.on_unloaded = prepare, lambda: unloaded.append(True)
    manager.load(cpu_request("fp32"))
    model_class = type(manager.loaded.model)
    models_before = len(live_models(model_class))
    with pytest.raises(LoadError, match="out of memory.*serving again") as caught:
        manager.load(cpu_request("bf16"))
    assert caught.value is not None  # held, as a caller showing its message holds it
    assert len(prepared) == 3 and len(unloaded) == 2  # the switch's unload, the failed one's
    assert [ref() is None for ref in prepared[:2]] == [True, True]
    assert manager.loaded.model is prepared[2]()
    assert len(live_models(model_class)) == models_before

    # A first load failing the same way: nothing to restore, and nothing looks loaded.
    manager.unload()
    prepared.clear()
    prepared.append(None)  # the next preparation is the failing second one
    with pytest.raises(LoadError, match="out of memory"):
        manager.load(cpu_request("fp32"))
    assert manager.loaded is None and manager.status() == {"loaded": False}
    assert prepared[1]() is None
