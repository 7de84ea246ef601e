"""A load that cannot work is refused while the current model keeps serving: nothing unloaded,
nothing reloaded. Real folders, real files, the real engine on the CPU."""

from __future__ import annotations

import json
import math
import os
import re

import pytest

from model_utils.engine import Engine
from model_utils.errors import LoadError
from model_utils.loading.loaded_model import LoadRequest
from model_utils.loading.placement import Placement, estimate_fit
from model_utils.loading.preflight import held_gb

from .helpers import FEW_TOKENS, HELLO, copy_demo, cpu_request


@pytest.fixture(scope="module")
def serving(tmp_path_factory, demo_path):
    """An engine serving the demo (fp32, CPU), with a models folder of broken candidates."""
    root = tmp_path_factory.mktemp("preflight")
    models, outside = root / "models", root / "outside"
    models.mkdir()
    outside.mkdir()
    pickled = copy_demo(demo_path, models / "pickle-only", weights=False)
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04 not really a pickle")
    bad_config = copy_demo(demo_path, models / "bad-config")
    (bad_config / "config.json").write_text("{not json")
    linked = copy_demo(demo_path, models / "linked", weights=False)
    (outside / "model.safetensors").write_bytes((demo_path / "model.safetensors").read_bytes())
    os.symlink(outside / "model.safetensors", linked / "model.safetensors")
    weights = (demo_path / "model.safetensors").read_bytes()
    damaged = copy_demo(demo_path, models / "damaged", weights=False)
    (damaged / "model.safetensors").write_bytes(bytes(range(256)) * 64)  # no header at all
    # A download cut short: a sound header, and the file ends before the tensors it lists.
    cut_short = copy_demo(demo_path, models / "cut-short", weights=False)
    (cut_short / "model.safetensors").write_bytes(weights[:len(weights) // 3])
    sharded = copy_demo(demo_path, models / "shard-missing")
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    bad_index = copy_demo(demo_path, models / "bad-index")
    (bad_index / "model.safetensors").rename(bad_index / "model-00001-of-00001.safetensors")
    (bad_index / "model.safetensors.index.json").write_text("{not json")
    engine = Engine(models_dir=models)
    engine.load(cpu_request("fp32"))
    yield engine
    engine.unload()


def _request(**fields) -> LoadRequest:
    return LoadRequest(**{"model": "demo", "mode": "fp32", "placement": Placement("cpu"),
                          **fields})


CASES = {
    "pickle-only folder": (_request(model="pickle-only"),
                           "has no .safetensors weights (it has pytorch_model.bin)"),
    "unreadable config": (_request(model="bad-config"), "its config cannot be read"),
    "weights linked from outside": (_request(model="linked"), "links outside the allowed"),
    "damaged weights": (_request(model="damaged"),
                        "the weights file model.safetensors is damaged or incomplete"),
    "weights cut short": (_request(model="cut-short"),
                          "the weights file model.safetensors is damaged or incomplete"),
    "a shard missing": (_request(model="shard-missing"), "model-00002-of-00002.safetensors, "
                        "named in model.safetensors.index.json, is missing"),
    "shard index unreadable": (_request(model="bad-index"), "the weights file "
                               "model.safetensors.index.json is damaged or incomplete"),
    "context of 1e12 tokens": (_request(context_tokens=10**12),
                               "context_tokens must be between 16 and 4096"),
    "context as a float": (_request(context_tokens=1e12), "must be a whole number"),
    "CPU cap too small": (_request(placement=Placement("cpu", max_memory_gb={"cpu": 0.0001})),
                          "does not fit"),
    "unknown device": (_request(placement=Placement("auto", max_memory_gb={"cuda:7": 5})),
                       "names device 'cuda:7', which this machine does not have"),
    "made-up device": (_request(placement=Placement("auto", max_memory_gb={"tpu": 1})),
                       "names device 'tpu'"),
    "cap not a number": (_request(placement=Placement("auto", max_memory_gb={"cpu": "lots"})),
                         "must be a positive number of GB"),
    "infinite cap": (_request(placement=Placement("auto", max_memory_gb={"cpu": math.inf})),
                     "must be a positive number of GB"),
    "caps as a list": (_request(placement=Placement("auto", max_memory_gb=[1, 2])),
                       "max_memory must map device names"),
    "unknown mode": (_request(mode="int3"), "unknown mode 'int3'"),
    "unknown compute dtype": (_request(mode="nf4", compute_dtype="fp8"),
                              "unknown compute dtype 'fp8'"),
    "model as a number": (_request(model=123), "model must be a name"),
    "placement as a number": (_request(placement=Placement(5)), "placement must be a name"),
    "unknown placement": (_request(placement=Placement("gpu-please")), "unknown placement"),
}


@pytest.mark.parametrize("case", CASES)
def test_refused_while_the_current_model_keeps_serving(serving, case):
    request, says = CASES[case]
    before = serving.manager.loaded
    with pytest.raises(LoadError) as caught:
        serving.load(request)
    message = str(caught.value)
    assert says in message, message
    assert "previous model" not in message  # nothing to restore: nothing was unloaded
    assert not re.search(r"(^|[\s'\"(])/\w", message), message  # no absolute server path
    # The very same loaded model, never unloaded, still answering.
    assert serving.manager.loaded is before and serving.manager.last_unload is None
    assert serving.generate_text(HELLO, FEW_TOKENS).stats.new_tokens == 4


def test_the_fit_counts_what_the_current_model_frees(serving, demo_path, monkeypatch):
    from transformers import AutoConfig

    from model_utils.loading import placement
    from model_utils.loading.modes import get_mode

    serving.generate_text(HELLO, FEW_TOKENS)  # the batch cache exists from the first reply
    loaded, cache_bytes = serving.manager.loaded, serving.serving.scheduler.runner.cache_bytes()
    assert cache_bytes > 0
    held = held_gb(loaded, serving.serving.held_gb())  # as the manager counts it for a switch
    assert held["cpu"] == pytest.approx(loaded.device_map["cpu"]["gb"] + cache_bytes / 2**30,
                                        rel=1e-9)
    assert serving.manager.held_beside() == serving.serving.held_gb()
    config = AutoConfig.from_pretrained(demo_path)
    # One reading of the free memory for both estimates: the machine's own moves between reads.
    free_now = placement.free_memory_gb()
    monkeypatch.setattr(placement, "free_memory_gb", lambda: dict(free_now))
    plain = estimate_fit(config, get_mode("fp32"), Placement("cpu"), context_tokens=512)
    counted = estimate_fit(config, get_mode("fp32"), Placement("cpu"), context_tokens=512,
                           reclaimable_gb={"cpu": 1000.0})
    assert counted.free_gb["cpu"] - plain.free_gb["cpu"] == pytest.approx(1000.0, abs=1.0)
    assert "that unloading the current model frees" in counted.message()


def test_without_a_context_asked_for_the_most_that_fits_is_taken_and_said(serving):
    """The model's own context (4096 for the demo) does not fit under a CPU cap that leaves
    room for ~2600 tokens of KV: the load takes 2048 and the status says why; a context asked
    for is kept and refused instead."""
    estimate = serving.estimate(_request())
    per_token = estimate.kv_cache_gb / estimate.context_tokens
    cap = estimate.weights_gb + 2600 * per_token
    capped = _request(placement=Placement("cpu", max_memory_gb={"cpu": cap}))
    fitted = serving.estimate(capped)
    assert fitted.fits and fitted.context_tokens == 2048
    engine = Engine()
    try:
        status = engine.load(capped)
        assert status["context_tokens"] == 2048
        assert "the model's own 4096 do not fit" in status["context_note"]
        with pytest.raises(LoadError, match="does not fit"):
            engine.load(_request(placement=Placement("cpu", max_memory_gb={"cpu": cap}),
                                 context_tokens=4096))
    finally:
        engine.unload()


def test_a_stale_shard_index_beside_a_single_file_is_not_read(demo_path, tmp_path):
    """from_pretrained reads model.safetensors before any index: so does the check."""
    from model_utils.loading.weight_files import unreadable_weights, weight_files

    folder = copy_demo(demo_path, tmp_path / "stale-index")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors"}}))
    assert weight_files(folder) == [folder / "model.safetensors"]
    assert unreadable_weights(folder) is None
