"""One request never ends another's reply: settings refused at the door, a sampler that cannot
produce NaN probabilities, and a failure of one row (prefill or decode step) ends that row only.

CPU, fp32 demo model, real engine and batch scheduler. The "attackers" are requests whose values
pass validation but sit at its edges, or (to reach the scheduler's own isolation) settings that
were never validated, handed to the scheduler directly.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import pytest
import torch

from model_utils.engine import eos_ids
from model_utils.errors import InvalidParameter
from model_utils.runtime.generation import REPETITION_PENALTY_RANGE
from model_utils.runtime.generation_settings import MAX_SEED, GenerationSettings
from model_utils.runtime.reply_stats import ReplyStats
from model_utils.runtime.sampling import sample_token

from .helpers import HELLO
from .test_batching import alone, greedy

VICTIM_PROMPTS = ["Tell me about the sea.", "What is two plus two?", "Name a colour."]


# -- at the door --------------------------------------------------------------------------------
@pytest.mark.parametrize("name, value, says", [
    ("seed", 2**70, "must be >= 0 and <= 9223372036854775807"),
    ("seed", True, "must be an integer"),
    ("temperature", math.inf, "finite number"),
    ("temperature", math.nan, "finite number"),
    ("temperature", 1e300, ">= 0 and <= 100"),
    ("top_p", math.nan, "finite number"),
    ("top_p", 1e-400, "in (0, 1]"),  # 0.0 once parsed
    ("repetition_penalty", 1e-300, ">= 0.01 and <= 10"),
    ("repetition_penalty", math.inf, "finite number"),
    ("top_k", 10**12, ">= 0 and <= 1000000"),
    ("max_new_tokens", -5, "must be at least 1, got -5"),
    ("max_new_tokens", 2.5, "must be an integer"),
    ("seed", "x" * 10**6, "must be an integer, got 'xxxxxxxxxxxxxxxxxxxxxxx... (1000002 "),
    ("top_k", 2**4000, "(1205 characters)"),
])
def test_out_of_range_settings_are_refused_with_a_plain_message(load_demo, name, value, says):
    engine = load_demo("fp32")
    with pytest.raises(InvalidParameter) as caught:
        next(engine.chat(HELLO, GenerationSettings(**{name: value})))
    message = str(caught.value)
    assert caught.value.name == name and says in message, message
    assert "Overflow" not in message and "Traceback" not in message and len(message) < 160


@pytest.mark.parametrize("temperature", [2.28e-39, 1e-300, 5e-6])
def test_a_temperature_below_the_epsilon_is_greedy(load_demo, temperature):
    engine = load_demo("fp32")
    serving = engine.serving
    settings = GenerationSettings(max_new_tokens=6, min_new_tokens=6, temperature=temperature,
                                  seed=1)
    resolved = settings.resolved(serving.loaded.model.generation_config,
                                 context_tokens=serving.loaded.context_tokens)
    assert resolved.temperature == 0.0
    reply = engine.generate_text(HELLO, settings)
    reference = engine.generate_text(HELLO, GenerationSettings(max_new_tokens=6,
                                                               min_new_tokens=6, temperature=0))
    assert reply.stats.finish_reason == "length" and reply.answer == reference.answer


# -- the sampler --------------------------------------------------------------------------------
def _settings(**values) -> GenerationSettings:
    base = {"max_new_tokens": 1, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
            "repetition_penalty": 1.0}
    return GenerationSettings(**{**base, **values})


@pytest.mark.parametrize("values", [
    {"temperature": 1e-4},
    {"temperature": 100.0},
    {"repetition_penalty": REPETITION_PENALTY_RANGE[0]},
    {"repetition_penalty": REPETITION_PENALTY_RANGE[1]},
    {"top_k": 1_000_000},
    {"top_p": 1e-300},
    {"temperature": 0.0, "repetition_penalty": REPETITION_PENALTY_RANGE[0]},
])
@pytest.mark.parametrize("poison", ["none", "nan", "inf", "-inf", "huge"])
def test_sample_token_always_returns_a_real_token(values, poison):
    vocab = 50
    logits = torch.linspace(-3, 3, vocab)
    if poison == "nan":
        logits[[3, 7]] = math.nan
    elif poison == "inf":
        logits[11] = math.inf
    elif poison == "-inf":
        logits[:] = -math.inf
    elif poison == "huge":
        logits = logits * 3e37  # overflows once divided by a small temperature or penalty
    seen = torch.tensor([1, 2, 3, 11, 49])
    generator = torch.Generator().manual_seed(MAX_SEED)
    for _ in range(5):
        token = int(sample_token(logits, _settings(**values), seen, generator))
        assert 0 <= token < vocab
        if poison == "nan":
            assert token not in (3, 7)


# -- concurrent victims beside attackers ----------------------------------------------------------
EDGE_ATTACKS = [
    {"temperature": 1e-4},
    {"temperature": 2.28e-39, "repetition_penalty": 1e-2},
    {"temperature": 0.7, "repetition_penalty": 10.0},
    {"temperature": 1.0, "top_k": 1_000_000, "top_p": 1e-300, "seed": MAX_SEED},
    {"temperature": 100.0, "top_p": 0.5, "repetition_penalty": 1e-2, "seed": 0},
]


def test_victims_beside_edge_settings_all_complete(load_demo):
    """Eight replies decoded together (the engine's max_batch): three greedy victims and five
    requests with the most extreme accepted settings. Every one completes its length, and each
    victim's reply is the one it gets alone."""
    engine = load_demo("fp32")
    n = 24
    victim_settings = greedy(n)
    attacker_settings = [GenerationSettings(max_new_tokens=n, min_new_tokens=n, **a)
                         for a in EDGE_ATTACKS]
    jobs = [[{"role": "user", "content": p}] for p in VICTIM_PROMPTS] + \
        [[{"role": "user", "content": f"attack {i}"}] for i in range(len(EDGE_ATTACKS))]
    settings = [victim_settings] * len(VICTIM_PROMPTS) + attacker_settings
    results: list = [None] * len(jobs)
    go = threading.Barrier(len(jobs))

    def one(i):
        go.wait()
        try:
            results[i] = engine.generate_text(jobs[i], settings[i])
        except BaseException as error:  # noqa: BLE001 - asserted below
            results[i] = error

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for i, result in enumerate(results):
        assert not isinstance(result, BaseException), (i, result)
        assert result.stats.finish_reason == "length" and result.stats.new_tokens == n, i
    assert max(r.stats.batched_with for r in results) > 1  # they did share steps
    for i in range(len(VICTIM_PROMPTS)):  # each victim's reply is the one it gets alone
        reference = engine.generate_text(jobs[i], victim_settings)
        assert (results[i].reasoning, results[i].answer) == (reference.reasoning,
                                                             reference.answer), i


class _Held:
    """Holds the decode worker, so that requests submitted meanwhile are admitted together,
    as one prefill group, when it is let go."""

    def __init__(self, engine):
        self.release = threading.Event()
        self.holding = threading.Event()

        def hold():
            self.holding.set()
            self.release.wait(60)

        engine.worker.post(hold)
        assert self.holding.wait(60)


def _victim_prompts(serving) -> list[list[int]]:
    return [serving.loaded.tokenizer(f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n",
                             add_special_tokens=False)["input_ids"] for p in VICTIM_PROMPTS]


def _consume(iterator, into: list, box: dict, key: str, on_first=None) -> threading.Thread:
    def run():
        try:
            for token in iterator:
                into.append(token)
                if on_first and len(into) == 1:
                    on_first()
        except BaseException as error:  # noqa: BLE001 - asserted by the test
            box[key] = error

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize("attack", ["seed", "token id"])
def test_a_request_that_fails_its_prefill_ends_alone_in_its_group(load_demo, attack):
    """Handed to the scheduler directly (nothing validated): a seed torch cannot take (2**70)
    fails the request's own set-up; a token id past the vocabulary fails the group's forward,
    which is then run again request by request. Either way the innocent prompts of the same
    group decode exactly what they decode alone, and only the bad one gets an error."""
    engine = load_demo("fp32")
    serving = engine.serving
    n = 12
    prompts = _victim_prompts(serving)
    if attack == "seed":
        bad_prompt = prompts[0]
        bad = GenerationSettings(max_new_tokens=n, temperature=1.0, top_p=1.0, top_k=0,
                                 repetition_penalty=1.0, seed=2**70)
    else:
        bad_prompt = [*prompts[0][:-1], serving.loaded.model.config.vocab_size + 5]
        bad = greedy(n)
    held = _Held(engine)
    outputs, errors, threads, stats = [], {}, [], []
    try:
        for i, prompt in enumerate([prompts[0], prompts[1], bad_prompt, prompts[2]]):
            settings = bad if i == 2 else greedy(n)
            stats.append(ReplyStats())
            outputs.append([])
            iterator = serving.scheduler.submit(prompt, settings, eos_ids=eos_ids(serving.loaded),
                                             stop=threading.Event(), stats=stats[-1])
            threads.append(_consume(iterator, outputs[-1], errors, str(i)))
    finally:
        held.release.set()
    for t in threads:
        t.join(timeout=300)
    assert set(errors) == {"2"} and stats[2].finish_reason == "error"
    assert outputs[2] == []
    for i, prompt in zip((0, 1, 3), (prompts[0], prompts[1], prompts[2])):
        assert stats[i].finish_reason == "length"
        assert outputs[i] == alone(serving, prompt, greedy(n)), i
    assert max(s.batched_with for s in stats) == 3  # the three decoded together


@dataclass(frozen=True)
class _TurnsBad(GenerationSettings):
    """Settings that no validated request has: after GOOD_SAMPLES tokens its top_k reads -1,
    which makes torch.topk raise inside sample_token (sample_token reads top_k twice a token)."""

    GOOD_SAMPLES = 5

    def __getattribute__(self, name):
        if name == "top_k":
            reads = object.__getattribute__(self, "__dict__").setdefault("_reads", [0])
            reads[0] += 1
            if reads[0] > 2 * _TurnsBad.GOOD_SAMPLES:
                return -1
            return 1000
        return object.__getattribute__(self, name)


def test_a_row_that_fails_in_a_decode_step_ends_alone(load_demo):
    """A row whose sampling raises in the middle of decoding (its settings turn bad after a few
    tokens) leaves the batch with its error; the rows decoding beside it go on and give
    their exact replies."""
    engine = load_demo("fp32")
    serving = engine.serving
    n = 160
    prompts = _victim_prompts(serving)
    attacker = _TurnsBad(max_new_tokens=n, min_new_tokens=n, temperature=1.0, top_p=1.0,
                         top_k=0, repetition_penalty=1.0, seed=3)
    held = _Held(engine)
    outputs, errors, threads, stats = [], {}, [], []
    try:
        for i, (prompt, settings) in enumerate([*[(p, greedy(n)) for p in prompts],
                                                (prompts[1], attacker)]):
            stats.append(ReplyStats())
            outputs.append([])
            iterator = serving.scheduler.submit(prompt, settings, eos_ids=eos_ids(serving.loaded),
                                             stop=threading.Event(), stats=stats[-1])
            threads.append(_consume(iterator, outputs[-1], errors, str(i)))
    finally:
        held.release.set()
    for t in threads:
        t.join(timeout=300)
    assert set(errors) == {"3"} and stats[3].finish_reason == "error"
    # It failed mid-decoding, beside the others (a token sampled in the step before the one
    # that failed may be void: it was still being read)
    assert 1 <= len(outputs[3]) <= _TurnsBad.GOOD_SAMPLES
    for i, prompt in enumerate(prompts):
        assert stats[i].finish_reason == "length"
        assert outputs[i] == alone(serving, prompt, greedy(n)), i
    # The engine serves the next reply as usual.
    assert engine.generate_text(HELLO, greedy(3)).stats.new_tokens == 3
