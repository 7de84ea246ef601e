"""The demo model answers the question asked: held-out questions about the app, worded apart
from its training data (tests/fixtures/demo_heldout_questions.json), are answered on topic as a
first turn and as the second or third turn of a conversation, and no tag text leaks into an
answer. A reply is on topic when it holds one of the question's keywords."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model_utils.runtime.generation_settings import GenerationSettings

from .helpers import cpu_request

GREEDY = GenerationSettings(temperature=0.0, max_new_tokens=120)
QUESTIONS = json.loads((Path(__file__).parents[1] / "fixtures" /
                        "demo_heldout_questions.json").read_text())["questions"]
TAGS = ("<think>", "</think>")
# The targets are 90 % as a first turn and 80 % as a follow-up. The build as shipped (recipe 5)
# answered 27 and 25 of 30; recipe 4's builds with other seeds or one thread gave 26-27 and
# 23-26 (BENCHMARKS.md, "The demo model"; benchmarks/demo_quality.py measures it): both
# targets lie inside the spread between builds, and the same recipe trains differently on
# different CPUs. These floors hold for every build measured and catch a recipe that got worse.
FIRST_TURN_FLOOR = 0.8
FOLLOW_UP_FLOOR = 0.75


def on_topic(answer: str, keywords: list[str]) -> bool:
    return any(keyword.lower() in answer.lower() for keyword in keywords)


def ask(engine, messages: list[dict], thinking: bool = False) -> str:
    answer = engine.generate_text(messages, GREEDY, thinking=thinking).answer
    assert not any(tag in answer for tag in TAGS), f"tag text in the answer: {answer!r}"
    return answer.strip()


@pytest.fixture(scope="module")
def demo(engine):
    """The session engine with the demo model in bf16, once for the module."""
    loaded = engine.manager.loaded
    if loaded is None or loaded.request != cpu_request("bf16"):
        engine.load(cpu_request("bf16"))
    return engine


@pytest.fixture(scope="module")
def first_turns(demo) -> list[str]:
    return [ask(demo, [{"role": "user", "content": q["question"]}]) for q in QUESTIONS]


def test_the_fixture_keeps_apart_from_the_training_data():
    from model_utils.loading.demo_chats import TOPICS, conversations

    # The seeds, and every wording the generator made of them (a history turn included).
    asked = [p for phrasings, _, _ in TOPICS for p in phrasings] + [
        m["content"] for c in conversations() for m in c["messages"] if m["role"] == "user"]
    trained = {p.lower().rstrip("?!. ") for p in asked}
    assert len(QUESTIONS) >= 20
    assert not [q["question"] for q in QUESTIONS if q["question"].lower().rstrip("?!. ")
                in trained]


def test_single_turn_answers_are_on_topic(first_turns):
    missed = [(q["question"], a) for q, a in zip(QUESTIONS, first_turns, strict=True)
              if not on_topic(a, q["keywords"])]
    rate = 1 - len(missed) / len(QUESTIONS)
    assert rate >= FIRST_TURN_FLOOR, f"{rate:.0%} on topic; missed: {missed}"


def test_follow_up_answers_are_on_topic(demo, first_turns):
    """Each question asked after one or two earlier ones (with the model's own replies)."""
    missed = []
    for i, question in enumerate(QUESTIONS):
        earlier = [(i - k) % len(QUESTIONS) for k in ((2, 1) if i % 2 else (1,))]
        history = [m for j in earlier for m in (
            {"role": "user", "content": QUESTIONS[j]["question"]},
            {"role": "assistant", "content": first_turns[j]})]
        answer = ask(demo, history + [{"role": "user", "content": question["question"]}])
        if not on_topic(answer, question["keywords"]):
            missed.append((question["question"], answer))
    rate = 1 - len(missed) / len(QUESTIONS)
    assert rate >= FOLLOW_UP_FLOOR, f"{rate:.0%} on topic; missed: {missed}"


def test_thinking_on_keeps_tags_out_of_the_answer(demo):
    for question in QUESTIONS[:10]:
        ask(demo, [{"role": "user", "content": question["question"]}], thinking=True)
