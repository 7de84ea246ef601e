"""Every mode of the table that can run on a CPU loads there, is really in that precision, and
generates."""

from __future__ import annotations

import pytest
import torch

from model_utils.loading.modes import MODES, get_mode, unavailable_reason

from .helpers import FEW_TOKENS, HELLO


def _cpu_modes():
    for name, mode in MODES.items():
        reason = unavailable_reason(mode, device="cpu")
        yield pytest.param(name, marks=pytest.mark.skip(reason=reason)) if reason else name


@pytest.mark.parametrize("mode_name", list(_cpu_modes()))
def test_mode_loads_on_cpu_and_generates(load_demo, mode_name):
    engine = load_demo(mode_name)
    status = engine.status()
    assert (status["mode"], status["placement"]) == (mode_name, "cpu")
    assert set(status["device_map"]) == {"cpu"}

    model = engine.manager.loaded.model
    _assert_precision(model, get_mode(mode_name))

    reply = engine.generate_text(HELLO, FEW_TOKENS)
    assert reply.done
    assert reply.stats.new_tokens == FEW_TOKENS.max_new_tokens
    assert reply.stats.finish_reason == "length"
    assert reply.stats.prompt_tokens > 0


def _assert_precision(model, mode) -> None:
    """The weights are what the mode promises: the dtype, or quantized layers of its kind."""
    import bitsandbytes as bnb

    from model_utils.layers.fp8_weights import Fp8Linear
    from model_utils.layers.weight_only import Int4WeightOnlyLinear, Int8WeightOnlyLinear

    assert model.get_input_embeddings().weight.dtype == mode.dtype
    q_proj = model.model.layers[0].self_attn.q_proj
    if mode.is_weight_only:
        kind = Fp8Linear if mode.weight_format == "fp8" else \
            Int4WeightOnlyLinear if mode.weight_only_bits == 4 else Int8WeightOnlyLinear
        assert isinstance(q_proj, kind)
    elif mode.quantization is None:
        assert type(q_proj) is torch.nn.Linear
        assert q_proj.weight.dtype == mode.dtype
    elif mode.quantization == "int8":
        assert isinstance(q_proj, bnb.nn.Linear8bitLt)
        assert q_proj.weight.dtype == torch.int8
    else:
        assert isinstance(q_proj, bnb.nn.Linear4bit)
        assert q_proj.weight.quant_type == mode.quantization
        assert q_proj.weight.quant_state.nested == mode.double_quant


def test_unknown_mode_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="unknown mode 'int3'.*nf4"):
        get_mode("int3")


def test_mode_for_other_hardware_says_where_it_runs():
    from dataclasses import replace

    gpu_only = replace(MODES["nf4"], name="gpu-nf4", runs_on=("cuda",))
    assert unavailable_reason(gpu_only, device="cpu") == (
        "gpu-nf4 does not run on cpu (runs on: cuda)")
    assert unavailable_reason(gpu_only, device="cuda") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without one")
def test_gpu_placement_without_a_gpu_is_refused(engine):
    from model_utils.errors import LoadError
    from model_utils.loading.loaded_model import LoadRequest
    from model_utils.loading.placement import Placement

    # Only cuda:N needs a GPU: accelerate's strategies place over the CPU and disk without one
    # (tests/model_utils/test_offload.py).
    for target in ("cuda:0", "cuda:1"):
        with pytest.raises(LoadError, match="needs a CUDA GPU and this machine has none"):
            engine.load(LoadRequest(mode="bf16", placement=Placement(target)))


def test_a_4bit_weight_counts_its_block_scales(load_demo):
    """The footprint shown is what the weights hold: nf4's per-block absmax is memory too
    (model.get_memory_footprint() leaves it out: 0.4 GB for a 7B model)."""
    from model_utils.loading.memory_accounting import stored_bytes
    from model_utils.memory import GB

    engine = load_demo("nf4")
    model = engine.manager.loaded.model
    weight = model.model.layers[0].self_attn.q_proj.weight
    state = weight.quant_state
    values = state.shape.numel()
    # packed 4-bit values, one float32 absmax per block, the 16-entry nf4 code
    assert stored_bytes(weight) == values // 2 + values // state.blocksize * 4 + 16 * 4
    assert engine.status()["footprint_gb"] * GB > model.get_memory_footprint()
