"""The weight-only int8 / int4 modes on the CPU: their numbers, their loading, their replies.

The CPU keeps int4 weights two to a byte and dequantizes them in every forward; a GPU keeps them
in tinygemm's layout (the `gpu` test at the end compares the two on the same weights).
"""

from __future__ import annotations

import threading
import weakref

import pytest
import torch
from torch import nn

from model_utils.engine import eos_ids
from model_utils.errors import LoadError
from model_utils.layers import int_quantization
from model_utils.layers.int_quantization import (
    dequantize_int4,
    pack_nibbles,
    quantize_int4,
    quantize_int8,
    unpack_nibbles,
)
from model_utils.layers.weight_only import Int4WeightOnlyLinear, Int8WeightOnlyLinear
from model_utils.loading.loaded_model import LoadRequest
from model_utils.loading.memory_accounting import stored_bytes
from model_utils.loading.modes import MODES, dropdown_choices, get_mode
from model_utils.loading.placement import Placement
from model_utils.memory import GB
from model_utils.runtime.decoders import EagerDecoder
from model_utils.runtime.generation import decode_tokens
from model_utils.runtime.generation_settings import GenerationSettings
from model_utils.runtime.reply_stats import ReplyStats

from .helpers import FEW_TOKENS, HELLO, cpu_request
from .test_switching import wide_models_dir  # noqa: F401 - a fixture: a 31M-parameter model

WEIGHT_ONLY = ("int4-wo", "int8-wo")


def greedy(n: int) -> GenerationSettings:
    return GenerationSettings(max_new_tokens=n, min_new_tokens=n, temperature=0.0, top_p=1.0,
                              top_k=0, repetition_penalty=1.0)


# -- the numbers ---------------------------------------------------------------------------------
def test_int4_groups_round_to_the_nearest_of_16_levels_of_a_range_searched_per_group(
        monkeypatch):
    torch.manual_seed(0)
    w = torch.randn(16, 256) * torch.linspace(0.01, 3, 16)[:, None]  # rows of different ranges
    w[3, 7] = 12.0  # an outlier: its group's range is worth clipping
    q, scales, zeros = quantize_int4(w, 128)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    assert scales.shape == zeros.shape == (16, 2) and scales.dtype == torch.bfloat16
    assert torch.equal(unpack_nibbles(pack_nibbles(q)), q)
    back = dequantize_int4(q, scales, zeros, torch.float32)
    step = scales.float().repeat_interleave(128, dim=1)
    low = (zeros.float() - 8 * scales.float()).repeat_interleave(128, dim=1)
    inside = (w >= low - 0.5 * step) & (w <= low + 15.5 * step)
    # Within its group's range a weight rounds to the nearest level (plus what storing the
    # scale and zero point in bf16 shifts the grid); beyond it, to the nearest end.
    bf16_shift = 0.02 * w.abs().amax(-1, keepdim=True)
    assert ((back - w).abs() <= 0.5 * step + bf16_shift)[inside].all()
    assert ((q == 0) | (q == 15))[~inside].all()

    # The search keeps each group's best range: never worse than the plain min-max one, and
    # better overall (Gaussian groups: the outermost few are worth clipping).
    def group_error(q, scales, zeros):
        return (dequantize_int4(q, scales, zeros, torch.float32) - w).square().reshape(
            16, 2, 128).sum(-1)

    searched = group_error(q, scales, zeros)
    monkeypatch.setattr(int_quantization, "INT4_RANGE_FRACTIONS", (1.0,))
    plain = group_error(*quantize_int4(w, 128))
    assert (searched <= plain * (1 + 1e-6)).all()
    assert searched[3, 0] < plain[3, 0] and searched.sum() < 0.95 * plain.sum()


def test_int8_rows_are_symmetric_with_one_scale_each():
    torch.manual_seed(0)
    w = torch.randn(8, 64)
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.shape == (8,)
    assert int(q.abs().max()) == 127
    back = q.float() * scales.float()[:, None]
    assert ((back - w).abs() <= 0.5 * scales.float()[:, None] + 1e-2 * w.abs().amax()).all()


@pytest.mark.parametrize("bits", [4, 8])
def test_a_weight_only_linear_computes_with_its_dequantized_weight(bits):
    torch.manual_seed(0)
    linear = nn.Linear(256, 64, bias=True)
    layer = Int4WeightOnlyLinear(linear, 128, kernel="dequantize") if bits == 4 \
        else Int8WeightOnlyLinear(linear)
    x = torch.randn(3, 5, 256)
    expected = x @ layer.dequantized(torch.float32).T + linear.bias
    assert torch.allclose(layer(x), expected, atol=1e-5)
    # and close to the full-precision layer it replaces
    assert (layer(x) - linear(x)).abs().max() < (0.2 if bits == 4 else 0.02)


def test_int8_in_fp16_does_not_overflow_where_the_unscaled_product_would():
    """Large activations (a trained model's reach thousands) times |q| up to 127 pass fp16's
    65504 before the row scale brings the product back; the fp16 forward scales first."""
    torch.manual_seed(0)
    linear = nn.Linear(1024, 16, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.rand(16, 1024) * 0.01)
    layer = Int8WeightOnlyLinear(linear)
    x = torch.full((1, 1024), 600.0)
    expected = linear(x)  # about 3000: representable in fp16
    assert (x.half() @ layer.qweight.half().T).isinf().any()  # what an unscaled product gives
    out = layer.half()(x.half())
    assert torch.isfinite(out).all()
    assert torch.allclose(out.float(), expected, rtol=0.02)


# -- loading -------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode_name", WEIGHT_ONLY)
def test_the_estimate_and_the_footprint_count_scales_and_zero_points(load_demo, mode_name):
    engine = load_demo(mode_name, compute_dtype="bf16")
    serving = engine.serving
    layer = serving.loaded.model.model.layers[0].mlp.down_proj  # 384 inputs, 128 outputs
    values = layer.in_features * layer.out_features
    if mode_name == "int4-wo":
        # two weights a byte, one bf16 scale and one bf16 zero point per 128 weights
        assert stored_bytes(layer.packed) + stored_bytes(layer.scales) + \
            stored_bytes(layer.zeros) == values // 2 + values // 128 * 4
    else:
        assert stored_bytes(layer.qweight) + stored_bytes(layer.scales) == values + 128 * 2
    estimate = engine.estimate(cpu_request(mode_name, compute_dtype="bf16")).weights_gb
    # to the byte but for the rotary embedding's frequency buffers (128 bytes, not weights)
    assert serving.loaded.footprint_gb * GB - estimate * GB == pytest.approx(128, abs=1)
    bf16 = engine.estimate(cpu_request("bf16")).weights_gb
    assert estimate < bf16


@pytest.mark.parametrize("mode_name", WEIGHT_ONLY)
def test_greedy_tokens_of_the_engine_equal_the_eager_decoders_in_fp32(load_demo, mode_name):
    """fp32 compute: the batch scheduler (padded prefill, shared cache, several replies at
    once) gives each prompt exactly the tokens the single-stream eager decoder gives it."""
    engine = load_demo(mode_name, compute_dtype="fp32")
    serving = engine.serving
    assert serving.loaded.model.get_input_embeddings().weight.dtype == torch.float32
    prompts = [serving.loaded.tokenizer(text)["input_ids"] for text in
               ("Hello, how are you today?", "Tell me about the sea",
                "A much longer prompt that goes on for a while, about lighthouses and ships")]
    settings = greedy(16)
    alone = [list(decode_tokens(EagerDecoder(serving.loaded.model), p, settings,
                                eos_ids=eos_ids(serving.loaded))) for p in prompts]
    results = [None] * len(prompts)

    def submit(i):
        results[i] = list(serving.scheduler.submit(prompts[i], settings, eos_ids=eos_ids(serving.loaded),
                                                stop=threading.Event(), stats=ReplyStats()))

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert results == alone
    assert all(len(r) == 16 for r in results)


def test_switching_to_and_from_weight_only_modes_answers_and_frees_the_model(engine):
    previous = None
    for mode in ("bf16", "int4-wo", "nf4", "int8-wo", "fp32", "int4-wo"):
        status = engine.load(cpu_request(mode))
        assert (status["mode"], status["placement"]) == (mode, "cpu")
        assert engine.generate_text(HELLO, FEW_TOKENS).stats.new_tokens == 4
        if previous is not None:
            assert previous() is None, "the previous model is still alive after the switch"
            assert engine.manager.last_unload.leftover == {}
        previous = weakref.ref(engine.manager.loaded.model)
        q_proj = engine.manager.loaded.model.model.layers[0].self_attn.q_proj
        if mode in WEIGHT_ONLY:
            assert isinstance(q_proj, Int4WeightOnlyLinear if mode == "int4-wo"
                              else Int8WeightOnlyLinear)
    engine.unload()
    assert previous() is None


def test_a_placement_over_several_devices_is_refused_and_the_model_kept(load_demo):
    engine = load_demo("bf16")
    with pytest.raises(LoadError, match="runs on one device: pick the CPU or one GPU.*"
                                        "bf16.*is serving again"):
        engine.load(LoadRequest(model="demo", mode="int4-wo", placement=Placement("balanced")))
    status = engine.status()
    assert status["mode"] == "bf16" and status["placement"] == "cpu"
    assert engine.generate_text(HELLO, FEW_TOKENS).stats.new_tokens == 4


# -- the mode dropdown ---------------------------------------------------------------------------
def test_the_dropdown_lists_the_modes_by_section_with_their_cost_on_the_device(monkeypatch):
    from model_utils.loading import modes

    for device in ("cpu", "cuda"):
        choices = dropdown_choices(device)
        assert sorted(name for _, name in choices) == sorted(MODES)
        sections = [label.split(" · ")[-1] for label, _ in choices]
        order = ["Full precision", "Fast quantized", "bitsandbytes memory savers"]
        assert sorted(set(sections), key=sections.index) == order  # each section together
        labels = {name: label for label, name in choices}
        assert labels["int4-wo"].startswith("int4-wo · int4 weight-only, group 128 · ")
        assert labels["nf4-dq"].startswith("nf4-dq · nf4 4-bit + double quant · ")
        assert labels["nf4"].startswith("nf4 4-bit · ") and labels["bf16"].startswith("bf16 · ")
        assert "0.53 B/param" in labels["int4-wo"] and "1.00 B/param" in labels["int8-wo"]
    for mslk, gemlite, int4_kernel in ((True, True, "MSLK's int4 kernels (a GEMV for a few replies)"),
                                       (False, True, "gemlite's int4 kernels"),
                                       (False, False, "tinygemm int4 kernel")):
        monkeypatch.setattr(modes, "_mslk_runs", lambda mslk=mslk: mslk)
        monkeypatch.setattr(modes, "_gemlite_runs", lambda gemlite=gemlite: gemlite)
        gpu = {name: label for label, name in dropdown_choices("cuda")}
        assert f"compiled CUDA-graph path, {int4_kernel}" in gpu["int4-wo"]
    assert "slow on this GPU: eager path" in gpu["int8"]
    assert all("slow on this GPU" not in gpu[m] for m in ("bf16", "int4-wo", "int8-wo", "nf4"))
    cpu = {name: label for label, name in dropdown_choices("cpu")}
    assert "weights dequantized in every forward" in cpu["int4-wo"]
    assert "the same fp8 arithmetic as on a GPU" in cpu["fp8"]
    # Each thing said once, the mode first: the closed box shows what is chosen.
    assert cpu["bf16"] == "bf16 · 2.00 B/param · Full precision"
    assert all(label.count("B/param") == 1 for label in {**cpu, **gpu}.values())
    assert get_mode("int4-wo").bytes_per_param == pytest.approx(0.5 + 4 / 128)


# -- the GPU kernel against the CPU's numbers ------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="tinygemm needs a CUDA GPU")
def test_tinygemm_gives_the_dequantized_product_of_the_same_weights():
    torch.manual_seed(0)
    linear = nn.Linear(1024, 512, bias=False, dtype=torch.bfloat16, device="cuda")
    fast = Int4WeightOnlyLinear(linear, 128, kernel="tinygemm")
    plain = Int4WeightOnlyLinear(linear, 128, kernel="dequantize")
    for rows in (1, 8, 128):
        x = torch.randn(rows, 1024, dtype=torch.bfloat16, device="cuda")
        expected = x.float() @ plain.dequantized(torch.float32).T
        assert (fast(x).float() - expected).abs().max() < 0.02 * expected.abs().max()
    assert stored_bytes(fast.packed) == 1024 * 512 // 2
    assert stored_bytes(fast.scales_and_zeros) == 1024 * 512 // 128 * 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled path needs a CUDA GPU")
@pytest.mark.parametrize("mode_name", WEIGHT_ONLY)
def test_on_a_gpu_the_mode_decodes_on_the_compiled_path_with_the_cpus_distributions(
        demo_path, mode_name):
    """Same weights, same numbers: the GPU's next-token distributions (tinygemm or the compiled
    int8 product, bf16) are those of the CPU's dequantized fp32 forward, up to bf16 rounding."""
    from model_utils.bench import quality
    from model_utils.engine import Engine
    from model_utils.layers.weight_only import load_quantized

    engine = Engine(max_batch=2)
    status = engine.load(LoadRequest(model="demo", mode=mode_name, placement=Placement("cuda:0")))
    assert status["decode_path"].startswith("paged-kv+cuda-graphs"), status
    serving = engine.serving
    sequences = quality.sequences(serving.loaded.tokenizer, 127)
    mode = get_mode(mode_name)
    cpu = load_quantized(demo_path, mode.weight_only_bits, mode.group_size,
                         device_map={"": "cpu"}, dtype=torch.float32)
    scores = quality.compare(quality.next_token_logprobs(cpu, sequences),
                             engine.worker.call(lambda: quality.next_token_logprobs(
                                 serving.loaded.model, sequences)))
    assert scores["kl_vs_fp32"] < 1e-3, scores
    reply = engine.generate_text(HELLO, FEW_TOKENS)
    assert reply.stats.new_tokens == 4
    engine.unload()


def test_a_checkpoint_larger_than_the_memory_available_is_refused_with_the_numbers(tmp_path):
    """The bf16 weights pass through CPU memory: a checkpoint that cannot is refused before
    anything is read (a sparse file of that size: no disk space is used)."""
    import psutil

    from model_utils.layers.weight_only import check_staging_memory

    check_staging_memory(tmp_path)  # nothing to load: nothing refused
    weights = tmp_path / "model.safetensors"
    with open(weights, "wb") as f:
        f.truncate(psutil.virtual_memory().total + 2**30)
    with pytest.raises(ValueError, match=r"its \d+\.\d GB of weights exceed the \d+\.\d GB of "
                                         "memory available"):
        check_staging_memory(tmp_path)


def test_unloading_a_weight_only_model_gives_its_memory_back(wide_models_dir):  # noqa: F811
    """Process RSS after each unload returns to where it was (test_switching.py explains the
    bound), and the unload gave back at least half of the quantized weights' footprint: neither
    the quantized layers nor the bf16 checkpoint they were made from stay behind. Read in a
    process of its own, as the switch chain is (a shared test process's other threads move
    its RSS by as much as the bound)."""
    from .test_switching import assert_unloads_give_memory_back, run_switch_chain

    # Warmed up on bf16 and each mode (first-use costs of the kernels, paid once), then each
    # weight-only mode twice; the engine's own answers and frees are checked by the chain.
    chain = run_switch_chain(wide_models_dir, ("bf16", *WEIGHT_ONLY),
                             (*WEIGHT_ONLY, *WEIGHT_ONLY))
    assert [u["model"].split()[-1] for u in chain["unloads"]] == [f"({m})" for m in
                                                                  (*WEIGHT_ONLY, *WEIGHT_ONLY)]
    assert_unloads_give_memory_back(chain["unloads"], baseline=chain["warmed_up_rss"])
