"""Qwen3.5's hybrid layers (Gated DeltaNet linear attention beside full attention) on the
batched path, on the CPU: a tiny model of the architecture built from its config here (random
fp32 weights: exact equality is the test), its replies decoded together equal to each decoded
alone and to plain generate; a checkpoint with a vision tower loads as its language model."""

from __future__ import annotations

import threading

import pytest
import torch

from model_utils.engine import Engine, eos_ids
from model_utils.loading.loaded_model import LoadRequest
from model_utils.loading.modes import unpackable_linears
from model_utils.loading.placement import Placement, kv_cache_bytes
from model_utils.runtime.decoders import EagerDecoder
from model_utils.runtime.generation import decode_tokens
from model_utils.runtime.generation_settings import GenerationSettings
from model_utils.runtime.reply_stats import ReplyStats

from .helpers import prefill_logits, record_padded_prefills, submitted_together

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            max_position_embeddings=4096)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
              patch_size=14, spatial_merge_size=2, temporal_patch_size=2)


def build(folder, *, vision: bool = False, strong_states: bool = False):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.qwen3_5.configuration_qwen3_5 import (
        Qwen3_5Config,
        Qwen3_5TextConfig,
    )
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForConditionalGeneration

    from model_utils.loading.demo_model import demo_model_path

    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
    text = {**TEXT, "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id}
    torch.manual_seed(0)
    if vision:
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text,
                                                              vision_config=VISION))
    else:
        model = AutoModelForCausalLM.from_config(Qwen3_5TextConfig(**text))
    if strong_states:
        # At the default initialisation the linear layers' states fade within a few tokens
        # and barely move the logits (a state zeroed by mistake changed them by 1e-4): with
        # little decay and a louder output, a wrong state shows.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("linear_attn.A_log"):
                    param.fill_(-6.0)
                elif name.endswith("linear_attn.out_proj.weight"):
                    param.mul_(8)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hybrid_folder(tmp_path_factory):
    return build(tmp_path_factory.mktemp("qwen3_5") / "tiny")


def load(folder, mode="fp32", **engine_kwargs) -> Engine:
    engine = Engine(**engine_kwargs)
    engine.registry.allow_root(str(folder))
    engine.load(LoadRequest(str(folder), mode, Placement("cpu")))
    return engine


@pytest.fixture(scope="module")
def hybrid(hybrid_folder):
    engine = load(hybrid_folder, max_batch=8)
    yield engine
    engine.unload()


def greedy(n: int) -> GenerationSettings:
    return GenerationSettings(max_new_tokens=n, min_new_tokens=n, temperature=0.0, top_p=1.0,
                              top_k=0, repetition_penalty=1.0)


def submit(serving, prompt, settings, stop=None):
    stats = ReplyStats()
    return list(serving.scheduler.submit(prompt, settings, eos_ids=eos_ids(serving.loaded),
                                      stop=stop or threading.Event(), stats=stats)), stats


def alone(serving, prompt, settings):
    return list(decode_tokens(EagerDecoder(serving.loaded.model), prompt, settings,
                              eos_ids=eos_ids(serving.loaded)))


def plain_generate(serving, prompt, n):
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = serving.loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                    min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def together(jobs):
    results = [None] * len(jobs)
    start = threading.Barrier(len(jobs))

    def one(i):
        start.wait()
        results[i] = jobs[i]()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return results


def test_a_hybrid_model_takes_the_batched_path(hybrid):
    serving = hybrid.serving
    assert serving.scheduler is not None, serving.decode_path_reason
    assert "concurrent replies decoded together" in serving.decode_path_reason
    runner = serving.scheduler.runner
    hybrid.worker.call(runner.blocks)  # the cache, made at first use
    assert runner.kv.states is not None and sorted(runner.kv.states.conv) == [0, 1, 2]
    assert runner.kv.keys[3] is not None and runner.kv.keys[0] is None


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_rows_of_mixed_lengths_decode_as_each_alone_and_as_plain_generate(hybrid, rows):
    serving = hybrid.serving
    prompts = [[(7 * j + 11 * i) % 900 + 5 for j in range(3 + (i * 97) % 260)]
               for i in range(rows)]
    settings = [greedy(12 + 3 * i) for i in range(rows)]
    expected = [alone(serving, p, s) for p, s in zip(prompts, settings)]
    got = together([lambda p=p, s=s: submit(serving, p, s) for p, s in zip(prompts, settings)])
    assert [tokens for tokens, _ in got] == expected
    if rows > 1:
        assert max(stats.batched_with for _, stats in got) > 1
    assert expected[0] == plain_generate(serving, prompts[0], settings[0].max_new_tokens)


def test_a_stopped_reply_and_one_that_ends_early_leave_the_others_exact(hybrid):
    serving = hybrid.serving
    prompts = [[20 + i + j for j in range(30 + 40 * i)] for i in range(4)]
    stop = threading.Event()
    lengths = [40, 6, 40, 40]  # the second ends mid-batch
    expected = [alone(serving, p, greedy(n)) for p, n in zip(prompts, lengths)]

    def stopped():
        stats, seen = ReplyStats(), 0
        for _ in serving.scheduler.submit(prompts[2], greedy(3000), eos_ids=eos_ids(serving.loaded),
                                       stop=stop, stats=stats):
            seen += 1
            if seen == 10:
                stop.set()
        return None, stats

    jobs = [lambda i=i: submit(serving, prompts[i], greedy(lengths[i])) for i in range(4)]
    jobs[2] = stopped
    got = together(jobs)
    assert got[2][1].finish_reason == "stop"
    for i in (0, 1, 3):
        assert got[i][0] == expected[i], i


def test_the_warm_up_prompts_leave_no_block_taken_and_replies_unchanged(hybrid):
    serving = hybrid.serving
    runner = serving.scheduler.runner
    prompt = [(5 * j) % 800 + 9 for j in range(70)]
    before = submit(serving, prompt, greedy(10))[0]
    free = hybrid.worker.call(lambda: runner.blocks().available())
    hybrid.worker.call(lambda: runner.prefill_untimed((16, 24, 10**9)))  # the last: too long
    assert hybrid.worker.call(lambda: runner.blocks().available()) == free
    assert submit(serving, prompt, greedy(10))[0] == before


def test_a_long_prompt_prefilled_in_chunks_carries_the_states_across_them(hybrid):
    tokens = [(13 * i) % 700 + 3 for i in range(200)]

    def logits(chunk):
        return prefill_logits(hybrid, tokens, chunk)

    whole = logits(1000)
    for chunk in (64, 90):
        torch.testing.assert_close(logits(chunk), whole, rtol=1e-4, atol=1e-4)


def test_a_preempted_hybrid_reply_resumes_from_a_fresh_state_and_stays_exact(hybrid_folder,
                                                                            monkeypatch):
    import model_utils.runtime.runner as runner

    monkeypatch.setattr(runner, "_free_bytes", lambda device: 1)  # the least KV there is
    engine = Engine(max_batch=8)
    engine.registry.allow_root(str(hybrid_folder))
    engine.load(LoadRequest(str(hybrid_folder), "fp32", Placement("cpu"), context_tokens=256))
    try:
        serving = engine.serving
        prompts = [[10 + i] + [(7 * j + i) % 300 + 5 for j in range(19)] for i in range(5)]
        expected = [alone(serving, p, greedy(40)) for p in prompts]
        got = together([lambda p=p: submit(serving, p, greedy(40)) for p in prompts])
        assert [tokens for tokens, _ in got] == expected
        assert serving.scheduler.kv_blocks()["preemptions"] >= 1
    finally:
        engine.unload()


def test_the_fit_counts_the_attention_layers_kv_and_the_linear_layers_state():
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(**TEXT, vocab_size=1000)
    one_attention_layer = 2 * 2 * 16 * 1000 * 2  # K and V, 2 heads of 16, 1000 tokens, bf16
    state = 3 * ((2 * 2 * 16 + 4 * 16) * 4 * 2 + 4 * 16 * 16 * 4)  # 3 linear layers
    assert kv_cache_bytes(config, 1000) == one_attention_layer + state


def test_bitsandbytes_modes_keep_the_layers_its_cpu_kernel_cannot_pack(hybrid_folder):
    from transformers import AutoConfig

    # in_proj_a / in_proj_b: one output per value head (4 here)
    assert unpackable_linears(AutoConfig.from_pretrained(hybrid_folder)) == ["in_proj_a",
                                                                             "in_proj_b"]


@pytest.mark.parametrize("mode", ["bf16", "nf4", "int8-wo", "fp8"])
def test_quantized_modes_load_and_chat(hybrid_folder, mode):
    engine = load(hybrid_folder, mode)
    try:
        reply = engine.generate_text([{"role": "user", "content": "hi"}], greedy(6))
        assert reply.stats.new_tokens == 6
        assert engine.serving.scheduler is not None
    finally:
        engine.unload()


def test_a_checkpoint_with_a_vision_tower_loads_as_its_language_model(tmp_path):
    folder = build(tmp_path / "vlm", vision=True)
    engine = load(folder)
    try:
        status = engine.status()
        assert any("vision tower is not loaded" in note for note in status["notes"])
        model = engine.manager.loaded.model
        assert type(model).__name__ == "Qwen3_5ForCausalLM"
        assert not any("visual" in name for name, _ in model.named_parameters())
        reply = engine.generate_text([{"role": "user", "content": "hi"}], greedy(5))
        assert reply.stats.new_tokens == 5
    finally:
        engine.unload()


@pytest.fixture(scope="module")
def strong_hybrid(tmp_path_factory):
    """An engine over a tiny hybrid model whose linear layers' states matter to its logits."""
    engine = load(build(tmp_path_factory.mktemp("qwen3_5") / "strong", strong_states=True),
                  max_batch=4)
    yield engine
    engine.unload()


def test_a_next_turn_starts_from_the_kept_states_and_stays_exact(strong_hybrid, monkeypatch):
    from model_utils.runtime.state_snapshots import snapshot_point

    serving = strong_hybrid.serving
    runner = serving.scheduler.runner
    monkeypatch.setattr(runner, "min_reuse_tokens", 16)  # the tiny prompts here are reused
    # The states at the kept point come from inside the prompt's one forward
    # (layers/gated_delta.py), not from a forward that stops there.
    assert runner.keeps_mid_forward
    first = [(11 * j) % 700 + 7 for j in range(120)]
    reply, stats = submit(serving, first, greedy(20))
    assert stats.cached_tokens == 0
    second = first + reply + [(3 * j) % 500 + 40 for j in range(30)]
    expected = alone(serving, second, greedy(15))
    got, stats = submit(serving, second, greedy(15))
    assert got == expected
    assert stats.cached_tokens == snapshot_point(len(first), 16) == 96
    # a prompt that parts from the first before its kept point starts from nothing
    other = first[:50] + [901] * 100
    got, stats = submit(serving, other, greedy(8))
    assert got == alone(serving, other, greedy(8)) and stats.cached_tokens == 0
    # states dropped between admission and prefill: the prefix is computed again, exactly
    third = second + got + [77] * 20
    monkeypatch.setattr(runner.snapshots, "restore", lambda name, slot: False)
    assert submit(serving, third, greedy(10))[0] == alone(serving, third, greedy(10))


def test_a_conversation_through_the_chat_template_reuses_its_earlier_turns(strong_hybrid,
                                                                         monkeypatch):
    hybrid = strong_hybrid
    runner = hybrid.serving.scheduler.runner
    monkeypatch.setattr(runner, "min_reuse_tokens", 16)
    messages = [{"role": "system", "content": "You answer questions about a chat app. " * 6},
                {"role": "user", "content": "How do I load a model in four-bit mode?"}]
    first = hybrid.generate_text(messages, greedy(12), thinking=False)
    messages += [{"role": "assistant", "content": first.answer},
                 {"role": "user", "content": "And how much memory does it take then?"}]
    second = hybrid.generate_text(messages, greedy(12), thinking=False)
    assert second.stats.cached_tokens >= 64, second.stats
    fresh = load(hybrid.manager.loaded.source.path, max_batch=1)
    try:
        assert fresh.generate_text(messages, greedy(12), thinking=False).answer == second.answer
    finally:
        fresh.unload()


def test_a_prefill_that_fails_keeps_no_states_for_later_prompts(strong_hybrid, monkeypatch):
    """A prompt whose forward fails past its snapshot's reservation (out of memory, say) must
    not leave that snapshot named: a later prompt that names the same blocks would start from
    states nobody wrote."""
    serving = strong_hybrid.serving
    runner = serving.scheduler.runner
    monkeypatch.setattr(runner, "min_reuse_tokens", 16)
    first = [(17 * j) % 650 + 9 for j in range(120)]  # tokens no other test here sends
    reply, _ = submit(serving, first, greedy(20))
    failing = first + reply + [(3 * j) % 500 + 40 for j in range(30)]  # kept at 144
    failed = []

    def fail_once(module, args, kwargs):
        if not failed:
            failed.append(True)
            raise RuntimeError("out of memory")

    hook = serving.loaded.model.model.layers[0].register_forward_pre_hook(fail_once,
                                                                       with_kwargs=True)
    try:
        with pytest.raises(RuntimeError, match="out of memory"):
            submit(serving, failing, greedy(5))
    finally:
        hook.remove()
    assert runner._name(failing, 144) not in runner.snapshots
    # a longer prompt computed afresh names the blocks up to that point ...
    longer = failing + [(5 * j) % 400 + 60 for j in range(30)]
    assert submit(serving, longer, greedy(5))[0] == alone(serving, longer, greedy(5))
    # ... and one that parts from it after 150 tokens starts from states computed for it
    parting = failing[:150] + [(13 * j) % 300 + 90 for j in range(20)]
    got, stats = submit(serving, parting, greedy(10))
    assert got == alone(serving, parting, greedy(10)), stats.cached_tokens


@pytest.mark.parametrize("architecture", ["qwen3_next", "qwen3_5_moe"])
def test_the_other_hybrids_batch_as_each_alone_and_as_plain_generate(tmp_path, architecture):
    """Qwen3-Next and Qwen3.5-MoE: the same Gated DeltaNet layers beside mixture-of-experts
    MLPs, on the same batched path."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig

    from model_utils.loading.demo_model import demo_model_path

    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
    config_class, extra = {"qwen3_next": (Qwen3NextConfig, {"intermediate_size": 128}),
                           "qwen3_5_moe": (Qwen3_5MoeTextConfig, {})}[architecture]
    moe = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
               num_experts_per_tok=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_class(
        **{k: v for k, v in TEXT.items() if k != "intermediate_size"}, **moe, **extra,
        vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id))
    model.save_pretrained(tmp_path / architecture)
    tokenizer.save_pretrained(tmp_path / architecture)
    engine = load(tmp_path / architecture, max_batch=4)
    try:
        serving = engine.serving
        assert serving.scheduler is not None, serving.decode_path_reason
        prompts = [[(7 * j + 11 * i) % 900 + 5 for j in range(3 + (i * 97) % 260)]
                   for i in range(3)]
        expected = [alone(serving, p, greedy(10)) for p in prompts]
        got = together([lambda p=p: submit(serving, p, greedy(10)) for p in prompts])
        assert [tokens for tokens, _ in got] == expected
        assert expected[0] == plain_generate(serving, prompts[0], 10)
    finally:
        engine.unload()


def test_prompts_prefilled_together_left_padded_decode_as_each_alone(strong_hybrid):
    """The prefill a GPU replays as CUDA graphs for hybrids (left_padded_prefill.py), run
    eagerly here: prompts of mixed lengths prefilled together, each reply exact."""
    serving = strong_hybrid.serving
    runner = serving.scheduler.runner
    strong_hybrid.worker.call(lambda: runner.use_padded_prefill())
    groups = record_padded_prefills(runner)
    prompts = [[(7 * j + 11 * i) % 900 + 5 for j in range(3 + 41 * i)] for i in range(4)]
    settings = [greedy(10 + i) for i in range(4)]
    expected = [alone(serving, p, s) for p, s in zip(prompts, settings)]
    try:
        results = submitted_together(strong_hybrid, [
            lambda p=p, s=s: submit(serving, p, s) for p, s in zip(prompts, settings)])
    finally:
        runner.padded_prefill = None
    assert [tokens for tokens, _ in results] == expected
    # every prompt went through it, in replays of several (rows x bucket within 256 tokens)
    assert sorted(sum(groups, [])) == [len(p) for p in prompts]
    assert max(len(g) for g in groups) > 1, groups


def test_the_logprob_checks_teacher_forcing_takes_each_padded_rows_own_states(strong_hybrid):
    """The bench's teacher-forced run of several sequences prefilled together (left padded, as
    a GPU does for short hybrid prompts) equals each sequence's run alone: each row decodes
    from its own prompt's linear-attention states, not from the first row's."""
    from model_utils.bench.logprob_runs import engine_teacher_forced

    runner = strong_hybrid.serving.scheduler.runner
    strong_hybrid.worker.call(lambda: runner.use_padded_prefill())
    groups = record_padded_prefills(runner)
    prompt = 12  # under min_reuse_tokens: no states to keep, so padded as the scheduler would
    sequences = [[(7 * j + 11 * i) % 900 + 5 for j in range(prompt + 8)] for i in range(3)]
    try:
        together = engine_teacher_forced(strong_hybrid, sequences, prompt)
        alone = [engine_teacher_forced(strong_hybrid, [s], prompt)[0] for s in sequences]
    finally:
        runner.padded_prefill = None
    assert groups[0] == [prompt] * 3  # the three were prefilled in one padded call
    for row, expected in enumerate(alone):
        torch.testing.assert_close(together[row], expected, atol=1e-4, rtol=0)
