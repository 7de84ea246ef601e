"""The logprob checks on a model with peaked distributions: the engine passes against plain
generate, and a side whose weights were perturbed fails them (the check can fail)."""

from __future__ import annotations

import pytest
import torch

from model_utils.bench import logprob_check as check
from model_utils.bench.logprob_runs import engine_greedy, engine_teacher_forced, plain_greedy
from model_utils.bench.peaked_model import sample_prompts, train
from model_utils.engine import Engine, eos_ids

from .helpers import cpu_request

PROMPT, NEW = 24, 40


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    folder = tmp_path_factory.mktemp("peaked") / "model"
    report = train(folder, hidden=64, layers=2, seconds=None, max_steps=150, window=64, batch=8)
    assert report["loss_last"] < report["loss_first"] - 1.5, report  # it learned something
    return folder


@pytest.fixture(scope="module")
def peaked_engine(peaked):
    engine = Engine(max_batch=4)
    engine.registry.allow_root(str(peaked))
    yield engine
    engine.unload()


def load(engine, folder, mode):
    engine.load(cpu_request(mode, model=str(folder)))
    return engine.manager.loaded


def plain_model(folder, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map={"": "cpu"})


def both_sides(engine, model, prompts):
    mine = engine_greedy(engine, prompts, NEW)
    theirs = plain_greedy(model, prompts, NEW)
    sequences = [p + s.tokens for p, s in zip(prompts, mine)]
    reference = check.fp32_copy(model)
    ref = check.teacher_forced_plain(reference, sequences, PROMPT)
    forced = check.error_ratio(
        check.kl_stats(ref, engine_teacher_forced(engine, sequences, PROMPT)),
        check.kl_stats(ref, check.teacher_forced_plain(model, sequences, PROMPT,
                                                       incremental=True)),
        check.kl_stats(ref, check.teacher_forced_plain(model, sequences, PROMPT)))
    close = check.check_logprobs_close(mine, theirs, tolerance=check.tolerance_for(model.dtype))
    return close, forced


@pytest.mark.parametrize("mode,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_engine_passes_against_plain_generate_on_a_trained_model(peaked, peaked_engine, mode,
                                                                 dtype):
    load(peaked_engine, peaked, mode)
    prompts = sample_prompts(peaked, 3, PROMPT)  # 3 rows: the batch pads them to 4
    close, forced = both_sides(peaked_engine, plain_model(peaked, dtype), prompts)
    assert close["close"], close
    assert forced["within_limit"], forced
    if mode == "fp32":
        assert close["first_mismatch"] == [None, None, None]
        assert forced["engine_vs_fp32"]["kl_max"] < 1e-5
    else:  # bf16 rounds: a measurable error, comparable on both sides
        assert forced["plain_vs_fp32"]["kl_mean"] > check.KL_FLOOR
    assert forced["engine_vs_fp32"]["top1_agreement"] > 0.9


def test_perturbed_weights_on_one_side_fail_both_checks(peaked, peaked_engine):
    load(peaked_engine, peaked, "fp32")
    model = plain_model(peaked, torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():  # the plain side is now another model, close to the first
        for name, param in model.named_parameters():
            if name.endswith("proj.weight"):
                param.add_(torch.randn_like(param) * param.std())
    prompts = sample_prompts(peaked, 3, PROMPT)
    close, forced = both_sides(peaked_engine, model, prompts)
    assert not close["close"], close
    assert any(i is not None for i in close["first_mismatch"])
    # The reference is the perturbed model's fp32 copy, so the engine (the other model) is far
    # from it while plain bf16-free fp32 is exact: the ratio fails by orders of magnitude.
    assert not forced["within_limit"] and forced["ratio"] > 100, forced


def steps(tokens, tops):
    """Steps whose step i has top ids tops[i] with log-probabilities -0.1, -1.0, -2.0, ..."""
    return check.Steps(tokens, [[-0.1 - i for i in range(len(t))] for t in tops], tops)


def test_compare_greedy_stops_at_the_first_difference():
    a = steps([1, 2, 3], [[1, 9], [2, 5], [3, 4]])
    b = steps([1, 5, 7], [[1, 9], [5, 2], [7, 8]])
    parting = check.compare_greedy(a, b, tolerance=0.5)
    # 2 and 5 swap places: each side gives each token -0.1 and -1.1, 1.0 apart
    assert parting.index == 1 and not parting.close
    assert parting.logprob_diff == pytest.approx(1.0)
    assert parting.margin_a == pytest.approx(1.0) and parting.margin_b == pytest.approx(1.0)
    assert check.compare_greedy(a, b, tolerance=1.01).close  # within 1.01, not 0.5
    # The token of one side outside the other's top-k: not close whatever the tolerance.
    c = steps([1, 6], [[1, 9], [6, 8]])
    far = check.compare_greedy(a, c, tolerance=100)
    assert far.index == 1 and not far.close and "not in" in far.reason
    assert check.compare_greedy(a, a, tolerance=0).close


def test_a_token_recorded_past_the_top_k_is_named_with_its_rank():
    """Alternatives are recorded past the top k the rule tests: a token at rank 6 of the other
    side still fails the rule, and the reason says where it was."""
    tops = [[2] + [10 + j for j in range(4)] + [5], [5, 2] + [20 + j for j in range(4)]]
    a, b = steps([1, 2], [[1], tops[0]]), steps([1, 5], [[1], tops[1]])
    parting = check.compare_greedy(a, b, tolerance=100)
    assert not parting.close and parting.rank_in_a == 5 and parting.rank_in_b == 1
    assert "rank 6 of A" in parting.reason, parting.reason
    assert parting.logprob_diff == pytest.approx(5.0)  # 5: -5.1 (A) against -0.1 (B)
    assert check.compare_greedy(a, b, tolerance=100, top_k=6).close


def test_the_reference_view_of_a_parting():
    a = steps([1, 2], [[1, 3], [2, 5]])
    b = steps([1, 5], [[1, 3], [5, 2]])
    reference = torch.full((2, 8), -20.0)
    reference[1, 2], reference[1, 5], reference[1, 7] = -1.0, -1.3, -0.5
    seen = check.reference_at({"index": 1}, a, b, reference)
    assert seen["top1"] == 7 and seen["rank_a_token"] == 1 and seen["rank_b_token"] == 2
    assert seen["gap"] == pytest.approx(0.3)
    # A: 2 at -0.1 against -1.0, 5 at -1.1 against -1.3; B: 5 at -0.1 against -1.3
    assert seen["error_a"] == pytest.approx(0.9) and seen["error_b"] == pytest.approx(1.2)


def test_a_request_records_the_top_logprobs_of_each_token(load_demo):
    engine = load_demo("fp32")
    loaded = engine.manager.loaded
    prompt = loaded.tokenizer("Hello, how are you today?")["input_ids"]
    (recorded,) = engine_greedy(engine, [prompt], 6)
    assert len(recorded.tokens) == 6 and len(recorded.top_ids) == 6
    # Greedy with the EOS held back (min_new_tokens): the likeliest token that is not one.
    eos = eos_ids(loaded)
    assert [next(i for i in ids if i not in eos) for ids in recorded.top_ids] == recorded.tokens
    assert all(len(ids) == check.RECORDED_K for ids in recorded.top_ids)
    assert all(lp[0] >= lp[-1] for lp in recorded.top_logprobs)


def test_a_long_sequence_teacher_forced_in_chunks_equals_one_pass(peaked, monkeypatch):
    """Past ONE_PASS_TOKENS the prompt goes through a cache in chunks (fp32 attention would
    hold a 16k prompt's whole score matrix): the same distributions as one forward."""
    model = plain_model(peaked, torch.float32)
    sequences = [[(5 * i + 3 * r) % 200 + 4 for i in range(PROMPT + 9)] for r in range(2)]
    whole = check.teacher_forced_plain(model, sequences, PROMPT)
    monkeypatch.setattr(check, "ONE_PASS_TOKENS", 8)
    monkeypatch.setattr(check, "ONE_PASS_CHUNK", 5)
    chunked = check.teacher_forced_plain(model, sequences, PROMPT)
    assert chunked.shape == whole.shape == (2, 9, whole.shape[-1])
    torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-4)
