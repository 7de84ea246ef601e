"""Fine-tuning with nothing but a model and a data file learns: the default steps and learning
rate follow the data's and the model's size (model_utils.training.defaults), and with them the
demo model recalls new facts (tests/fixtures/new_facts.jsonl, ten facts in twelve rows) greedily
through the engine afterwards."""

from __future__ import annotations

import json
import time

from model_utils.runtime.generation_settings import GenerationSettings
from model_utils.training import defaults

from .helpers import FIXTURES, cpu_request
from .test_finetune import finetune

FACTS = FIXTURES / "new_facts.jsonl"
GREEDY = GenerationSettings(temperature=0.0, max_new_tokens=40)


def test_a_small_data_set_gets_the_minimum_steps_and_a_tiny_model_its_rate():
    tiny = defaults.plan(method="lora", parameters=1_300_000, n_examples=12, batch_size=4)
    assert tiny.steps == defaults.MIN_STEPS and "are 9; at least" in tiny.steps_reason
    assert tiny.lr == 5e-3 and "under 100M" in tiny.lr_reason
    large = defaults.plan(method="lora", parameters=7_000_000_000, n_examples=4000,
                          batch_size=4, grad_accum=2)
    assert large.steps == 1500 and large.lr == 2e-4
    assert defaults.plan(method="full", parameters=7_000_000_000, n_examples=None,
                         batch_size=4).lr == 2e-5
    given = defaults.plan(method="lora", parameters=1, n_examples=12, batch_size=4, steps=7,
                          lr=1e-4)
    assert (given.steps, given.lr, given.steps_reason, given.lr_reason) == \
        (7, 1e-4, "as given", "as given")


def test_the_defaults_learn_new_facts(tmp_path, demo_path):
    out = tmp_path / "models" / "facts"
    started = time.monotonic()
    result = finetune("--model", "demo", "--data", str(FACTS), "--out", str(out))
    took = time.monotonic() - started
    assert "200 steps (3 epochs of 12 examples are 9; at least 200)" in result.stdout
    assert "learning rate 0.005 (lora on a model under 100M parameters)" in result.stdout
    assert took < 300, f"the default run took {took:.0f} s"
    from model_utils.engine import Engine

    engine = Engine(models_dir=out.parent)
    try:
        engine.load(cpu_request("bf16", model="facts"))
        facts = {}
        for line in FACTS.read_text().splitlines():
            user, assistant = json.loads(line)["messages"]
            facts.setdefault(assistant["content"], user["content"])
        recalled = []
        for answer, question in facts.items():
            reply = engine.generate_text([{"role": "user", "content": question}], GREEDY,
                                         thinking=False).answer.strip()
            recalled.append(reply == answer)
    finally:
        engine.unload()
    assert len(facts) == 10
    assert sum(recalled) >= 8, list(zip(facts, recalled, strict=True))
