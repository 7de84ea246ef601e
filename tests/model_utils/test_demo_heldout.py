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
# The targets (90 % as a first turn, 80 % as a follow-up) are not met yet: the demo model as
# built now answered 12 of 30 as a first turn and 1 of 30 as a follow-up (BENCHMARKS.md, "The
# demo model", has a recipe that was tried and not kept). Strict: once a build meets them,
# these marks must go.
NOT_YET = pytest.mark.xfail(strict=True, reason="the demo model answers held-out wordings "
                            "on topic 40 % as a first turn, 3 % as a follow-up")


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


@NOT_YET
def test_single_turn_answers_are_on_topic(first_turns):
    missed = [(q["question"], a) for q, a in zip(QUESTIONS, first_turns, strict=True)
              if not on_topic(a, q["keywords"])]
    rate = 1 - len(missed) / len(QUESTIONS)
    assert rate >= 0.9, f"{rate:.0%} on topic; missed: {missed}"


@NOT_YET
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
    assert rate >= 0.8, f"{rate:.0%} on topic; missed: {missed}"


def test_thinking_on_keeps_tags_out_of_the_answer(demo):
    for question in QUESTIONS[:10]:
        ask(demo, [{"role": "user", "content": question["question"]}], thinking=True)
