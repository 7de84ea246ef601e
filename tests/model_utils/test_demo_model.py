"""The demo model answers: greedy replies to the data's questions and to close paraphrases are
the trained sentences, with thinking on (reasoning where the data has it) and off."""

from __future__ import annotations

import json

import pytest

from model_utils.loading.demo_chats import DATA_FILE, TOPICS, conversations
from model_utils.runtime.generation_settings import GenerationSettings

GREEDY = GenerationSettings(temperature=0.0, max_new_tokens=120)
ANSWERS = {answer for _, answer, _ in TOPICS}


def answer_of(question: str) -> str:
    return next(answer for phrasings, answer, _ in TOPICS if question in phrasings)


def test_the_committed_data_is_what_the_generator_writes():
    committed = [json.loads(line) for line in DATA_FILE.read_text().splitlines()]
    assert committed == conversations()
    # A bound on the committed file's size (about 2.5 MB with the follow-ups of up to five
    # earlier turns), so that a generator change that bloats it is noticed.
    assert 300 <= len(committed) and DATA_FILE.stat().st_size < 3_000_000


@pytest.mark.parametrize("question", ["Hello", "What is nf4?", "How do I switch modes?",
                                      "What do the memory cards show?",
                                      "How do I share the app safely?",
                                      "How do I run the benchmark?", "What does the CLI do?"])
def test_it_answers_the_data_questions(load_demo, question):
    engine = load_demo("bf16")
    for thinking in (True, False):
        reply = engine.generate_text([{"role": "user", "content": question}], GREEDY,
                                     thinking=thinking)
        assert reply.answer.strip() == answer_of(question)


# Paraphrases the demo answers wherever it was built: the same training rounds differently on
# different CPUs, and a build on an AMD EPYC without AVX-512 did not answer "Explain what the
# memory cards display" as the builds elsewhere did.
@pytest.mark.parametrize("paraphrase, topic", [
    ("hi there", "Hello"), ("what does nf4-dq mean", "What is nf4-dq?"),
    ("how to share the app with a friend safely?", "How do I share the app safely?"),
    ("how do I benchmark?", "How do I run the benchmark?")])
def test_it_answers_close_paraphrases(load_demo, paraphrase, topic):
    reply = load_demo("bf16").generate_text([{"role": "user", "content": paraphrase}], GREEDY,
                                            thinking=False)
    assert reply.answer.strip() == answer_of(topic)


def test_thinking_shows_real_reasoning(load_demo):
    reply = load_demo("bf16").generate_text(
        [{"role": "user", "content": "Which mode should I pick?"}], GREEDY, thinking=True)
    assert "depends on memory" in reply.reasoning
    assert reply.answer.strip() == answer_of("Which mode should I pick?")


def test_the_build_reports_its_steps_as_one_load_stage():
    """The Model tab's stage text follows the build's training steps (no build needed here)."""
    from model_utils.loading.demo_model import _step_reporter
    from model_utils.loading.load_stages import StageClock

    seen = []
    clock = StageClock(lambda fraction, message: seen.append((fraction, message)))
    report = _step_reporter(clock)
    for done in (1, 2):
        report(done, 2, 0.5)
    assert seen[-1] == (0.2, "building the demo model: step 2/2 (loss 0.50)")
    assert [stage.name for stage in clock.finish()] == ["building the demo model"]


def test_the_tokenizer_alone_is_the_trained_demos(tmp_path, monkeypatch):
    """A random benchmark model takes the demo's tokenizer: built without training where no
    demo is cached, it must be the same tokenizer the trained demo carries."""
    from transformers import AutoTokenizer

    from model_utils.loading.demo_model import demo_model_path, demo_tokenizer

    trained = AutoTokenizer.from_pretrained(demo_model_path())
    monkeypatch.setenv("QWEN_CHAT_CACHE", str(tmp_path))  # no demo built here
    untrained = demo_tokenizer()
    assert not list(tmp_path.iterdir())  # nothing was trained or written
    assert untrained.get_vocab() == trained.get_vocab()
    assert untrained.chat_template == trained.chat_template
    assert (untrained.eos_token, untrained.pad_token) == (trained.eos_token, trained.pad_token)
    text = "<think>\nmodes</think>\n\nUse nf4 to save memory."
    assert untrained(text)["input_ids"] == trained(text)["input_ids"]
