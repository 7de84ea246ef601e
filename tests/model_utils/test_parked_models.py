"""--park-gb on the CPU: a switch keeps the model it replaced, a switch back takes it instead of
reading the checkpoint, its replies are the fresh load's, and what would make it stale or
exceed the limit is not taken or not kept. (On a GPU the weights also move to page-locked host
memory and back: tests/gpu/test_parked_models.py.)"""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch

from model_utils.engine import Engine
from model_utils.loading.host_copy import HostCopy, model_weights, move_weights
from model_utils.loading.parked_models import ParkedModels, unparkable_reason
from model_utils.runtime.generation_settings import GenerationSettings

from .helpers import copy_demo, cpu_request

ASK = [{"role": "user", "content": "How do I share the app?"}]


def reply(engine: Engine) -> str:
    return engine.generate_text(ASK, GenerationSettings.greedy(max_new_tokens=12),
                                thinking=False).answer


def stage_names(engine: Engine) -> list[str]:
    return [stage["stage"] for stage in engine.status()["load_stages"]]


@pytest.fixture
def parking(demo_path):
    engine = Engine(park_gb=1)
    yield engine
    engine.unload()


def test_a_switch_back_takes_the_parked_model_and_answers_as_a_fresh_load(parking):
    first = parking.load(cpu_request("fp32"))
    model = parking.manager.loaded.model
    fresh = reply(parking)
    parking.load(cpu_request("bf16"))
    assert [name.endswith("(fp32)") for name in parking.status()["parked"]["models"]] == [True]
    assert parking.manager.last_unload.parked_gb == pytest.approx(first["footprint_gb"], abs=1e-4)
    assert parking.manager.last_unload.model_kept_by == []  # parked on purpose: not a leak

    back = parking.load(cpu_request("fp32"))
    assert parking.manager.loaded.model is model  # not read again
    assert not any(name.startswith("loading weights") for name in stage_names(parking))
    assert any(name.startswith("taking the parked") for name in stage_names(parking))
    assert back["last_switch"]["from_caches"] == ["parked weights"]
    assert reply(parking) == fresh
    # Now parked: the bf16 model the switch replaced, and no longer the fp32 one in use.
    assert [name.endswith("(bf16)") for name in parking.status()["parked"]["models"]] == [True]


@pytest.fixture
def as_the_app(monkeypatch):
    """What a tuned process does (process_tuning.tune_process): everything alive after a load is
    frozen out of the garbage collector's passes. Automatic passes are off, so that only the
    engine's own collections free a model held in reference cycles."""
    from model_utils import process_tuning

    monkeypatch.setattr(process_tuning, "_tuned", True)
    gc.disable()
    yield
    gc.enable()
    gc.unfreeze()
    gc.collect()


def test_an_unload_frees_the_parked_models(parking, as_the_app):
    parking.load(cpu_request("fp32"))
    model = parking.manager.loaded.model
    # In a reference cycle, as a model on the GPU's compiled path is: refcounts alone never
    # free it, a collection must.
    model.__dict__["_held_by_itself"] = model
    parked = weakref.ref(model)
    del model
    parking.load(cpu_request("bf16"))  # frozen with it: the fp32 model, parked
    assert parked() is not None
    parking.unload()
    assert parked() is None and parking.status()["parked"]["models"] == []


def test_a_model_over_the_limit_or_changed_since_is_not_taken(tmp_path, demo_path):
    models = tmp_path / "models"
    folder = copy_demo(demo_path, models / "copy")
    engine = Engine(models_dir=str(models), park_gb=1)
    try:
        engine.load(cpu_request("fp32", model="copy"))
        first = engine.manager.loaded.model
        engine.load(cpu_request("bf16", model="copy"))
        weights = next(folder.glob("*.safetensors"))
        stat = weights.stat()
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # replaced in place
        engine.load(cpu_request("fp32", model="copy"))
        assert engine.manager.loaded.model is not first
        assert any(name.startswith("loading weights") for name in stage_names(engine))
    finally:
        engine.unload()

    limited = ParkedModels(limit_gb=1e-4)  # the limit in GB: the demo's fp32 is a few MB
    engine.load(cpu_request("fp32"))
    assert "exceed" in limited.park(engine.manager.loaded) and limited.names() == []
    engine.unload()

    small = Engine(park_gb=0)  # off: nothing is kept
    try:
        small.load(cpu_request("fp32"))
        gone = weakref.ref(small.manager.loaded.model)
        small.load(cpu_request("bf16"))
        assert gone() is None and "parked" not in small.status()
    finally:
        small.unload()


def test_a_host_copy_keeps_every_weight_in_one_buffer_with_its_shape_strides_and_ties():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=True))
    model[1].weight = model[0].weight  # tied, as an embedding and lm_head often are
    model[1].register_buffer("transposed", torch.arange(12.0).reshape(3, 4).t())  # strided
    model[1].register_buffer("mask", torch.tensor([True, False, True]))
    before = {name: t.clone() for name, t in model.state_dict().items()}
    strides = {name: t.stride() for name, t in model.state_dict().items()}

    host = HostCopy(model_weights(model))
    move_weights(model, host.copy)

    assert model[1].weight is model[0].weight
    start, end = host.buffer.data_ptr(), host.buffer.data_ptr() + host.buffer.numel()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
        assert tensor.stride() == strides[name], name
        assert start <= tensor.data_ptr() < end and (tensor.data_ptr() - start) % HostCopy.ALIGN == 0
    host.release()
    assert host.buffer is None
    assert torch.equal(model[1].transposed, before["1.transposed"])  # the views keep the memory


def test_parking_the_same_request_again_releases_the_older_copys_buffer(parking):
    parking.load(cpu_request("fp32"))
    parking.load(cpu_request("bf16"))
    parked = parking.manager.parked
    (older,) = parked._parked.values()
    host = older.host = HostCopy(model_weights(older.loaded.model))  # as a GPU model's holds one
    assert parked.park(older.loaded) == ""
    assert host.buffer is None and len(parked.names()) == 1


def test_a_spare_buffer_takes_the_next_model_parked_and_the_smallest_that_fits_is_chosen():
    small = torch.nn.Linear(4, 4)
    large = torch.nn.Linear(16, 16)
    left = HostCopy(model_weights(large))
    move_weights(large, left.copy)
    move_weights(large, lambda t: t.clone())  # taken back: no view into the buffer is left
    place = left.buffer.data_ptr()

    with pytest.raises(ValueError, match="smaller"):
        HostCopy(model_weights(torch.nn.Linear(32, 32)), left)
    before = {name: t.clone() for name, t in small.state_dict().items()}
    reused = HostCopy(model_weights(small), left)
    move_weights(small, reused.copy)
    assert left.buffer is None and reused.buffer.data_ptr() == place
    for name, tensor in small.state_dict().items():
        assert torch.equal(tensor, before[name]) and tensor.data_ptr() >= place, name

    parked = ParkedModels(limit_gb=1)
    spares = [HostCopy(model_weights(torch.nn.Linear(n, n))) for n in (32, 8, 16)]
    parked._spares = list(spares)
    assert parked.gb == pytest.approx(sum(s.buffer.numel() for s in spares) / 1024**3)
    assert parked._take_spare(HostCopy.needed_bytes(model_weights(torch.nn.Linear(6, 6)))) is spares[1]
    assert parked._take_spare(10**9) is None
    assert parked._take_spare(300) is None  # every spare left is over 1.5x that: idle room
    assert parked._make_room() and spares[0].buffer is None  # spares go first, oldest first
    parked.clear()
    assert spares[2].buffer is None and parked.gb == 0 and not parked._make_room()


def test_a_spare_made_ahead_fits_the_limit_and_takes_the_weights_parked_later():
    model = torch.nn.Linear(16, 16)
    needed = HostCopy.needed_bytes(model_weights(model))
    parked = ParkedModels(limit_gb=1)
    parked._reserving = parked.reserve(needed)
    parked.wait()
    (spare,) = parked._spares
    assert spare.buffer.numel() == needed and parked.gb == pytest.approx(needed / 1024**3)
    assert parked.reserve(needed) is None  # one that fits is there already
    assert parked.reserve(2 * 1024**3) is None  # over the limit: nothing is dropped for it

    place = spare.buffer.data_ptr()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    host = HostCopy(model_weights(model), parked._take_spare(needed))
    move_weights(model, host.copy)
    assert host.buffer.data_ptr() == place and not parked._spares
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    host.release()


def test_a_cpu_model_gets_no_spare_buffer_made_ahead(parking):
    parking.load(cpu_request("fp32"))
    parked = parking.manager.parked
    assert parked._reserving is None and not parked._spares


def reachable_storages(root) -> dict[int, str]:
    """data_ptr -> a path to it, of every tensor reachable from `root` through modules,
    containers, tensors' own attributes and bitsandbytes' objects: found without the walk
    the parking code uses, so that a tensor it misses shows here."""
    found, seen, stack = {}, set(), [(root, "model")]
    while stack:
        obj, path = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            stack += [(value, f"{path}[{key}]") for key, value in obj.items()]
        elif isinstance(obj, list | tuple):
            stack += [(value, f"{path}[]") for value in obj]
        elif isinstance(obj, torch.Tensor | torch.nn.Module) or \
                type(obj).__module__.startswith("bitsandbytes"):
            if isinstance(obj, torch.Tensor) and obj.numel():
                found.setdefault(obj.data_ptr(), path)
            stack += [(value, f"{path}.{key}") for key, value in vars(obj).items()]
    return found


@pytest.mark.parametrize("mode", ["nf4", "nf4-dq"])
def test_a_4bit_model_moves_whole_with_its_quantization_state(demo_path, mode):
    """nf4 parks: every tensor of its weights, bitsandbytes' quantization state included (with
    double quant, the nested state's too), goes where parking moves it (on a GPU: host memory),
    and the model answers as a fresh load does."""
    fresh = Engine()
    fresh.load(cpu_request(mode))
    expected = reply(fresh)
    fresh.unload()
    engine = Engine()
    try:
        engine.load(cpu_request(mode))
        model = engine.manager.loaded.model
        states = [p.quant_state for p in model.parameters() if type(p).__name__ == "Params4bit"]
        assert states and all((s.state2 is not None) == (mode == "nf4-dq") for s in states)
        # Before any forward: on some CPUs bitsandbytes' first one repacks the 4-bit weights
        # (and drops the nested state), a layout a GPU model never has.
        before = reachable_storages(model)
        assert HostCopy.needed_bytes(model_weights(model)) >= sum(
            t.numel() * t.element_size() for t in model_weights(model))
        moved = []  # the originals, kept alive so that their addresses are not reused
        move_weights(model, lambda t: moved.append(t) or t.clone())
        left = {ptr: path for ptr, path in reachable_storages(model).items() if ptr in before}
        assert not left, left  # nothing of the model stayed where it was
        assert {t.data_ptr() for t in moved if t.numel()} >= set(before)
        assert reply(engine) == expected
    finally:
        engine.unload()


def test_a_switch_back_to_nf4_takes_it_parked_and_llm_int8_is_not_parked(parking):
    parking.load(cpu_request("nf4"))
    model, fresh = parking.manager.loaded.model, reply(parking)
    parking.load(cpu_request("int8"))
    assert parking.manager.parked.names()[0].endswith("(nf4)")
    assert "LLM.int8" in unparkable_reason(parking.manager.loaded)
    back = parking.load(cpu_request("nf4"))
    assert parking.manager.loaded.model is model
    assert back["last_switch"]["from_caches"] == ["parked weights"]
    assert reply(parking) == fresh
    assert parking.manager.parked.names() == []  # nf4 taken back, int8 freed
