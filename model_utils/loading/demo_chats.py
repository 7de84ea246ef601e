"""The demo model's training data: conversations about this app, written out as JSONL.

    python -m model_utils.loading.demo_chats            # rewrites model_utils/loading/data/demo_chats.jsonl

The topics (demo_topics.py) give a few hand-written seed phrasings of each question and one
answer. A tiny model learns to answer a question it has never seen only from many wordings of
each topic, so every seed is varied here: synonyms swapped in (GPU / graphics card, stop /
cancel, ...), question openers changed (How do I / Is there a way to / I want to ...), politeness
and greetings added or left out, case and punctuation changed. Each topic is then asked
alone, and again after one or two unrelated earlier turns, so that the reply follows the last
question and not the history. Topics with a `reasoning` line put it in the assistant's <think>
block (the Thinking switch shows real reasoning), and are also answered without it (what
follows the empty think block the template writes when Thinking is off). The output is
deterministic (a fixed seed): the demo model's cache is keyed by the file's hash, and a test
checks that the committed file is what this writes.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from .demo_topics import GREETING, TOPICS

__all__ = ["DATA_FILE", "GREETING", "TOPICS", "conversations", "write"]

DATA_FILE = Path(__file__).with_name("data") / "demo_chats.jsonl"
SEED = 7
SINGLE_PER_TOPIC = 48  # distinct wordings asked as a first turn
FOLLOW_UPS_PER_TOPIC = 20  # the same topic asked after earlier turns

SYSTEM_PROMPTS = ["You are a helpful assistant.", "Be brief.", "You answer questions about "
                  "this app."]
OPENERS = ["Hi! ", "Hello, ", "Hey, ", "Quick question: ", "Please tell me: ", "Question: ",
           "Sorry, ", "One more thing: ", "Ok, ", "So, ", "Excuse me, ", "I'd like to know: ",
           "Could you explain: ", "Help me out: ", "Another question: ", "Now, "]
CLOSERS = [" Thanks!", " Thank you.", " please", " Please help.", " :)", " Any idea?",
           " I am new to this.", " Cheers", " thx"]

_HOW = ["How can I", "How should I", "How would I", "What is the way to", "Is there a way to",
        "Can I", "Tell me how to", "Explain how to", "I want to", "How to", "Show me how to",
        "What do I do to", "I need to", "What are the steps to", "Where do I",
        "Is it possible to"]
# (pattern, alternatives): each match is swapped for one of the alternatives half the time.
# Case-sensitive, so a capitalised UI name ("Memory tab") keeps its spelling.
SYNONYMS: list[tuple[str, list[str]]] = [
    (r"\bHow do I\b", _HOW), (r"\bHow can I\b", _HOW),
    (r"\bWhat is\b", ["What's", "Explain", "Tell me about", "Describe", "Define",
                      "What exactly is", "Can you explain"]),
    (r"\bWhat are\b", ["What're", "Tell me about", "Describe", "List"]),
    (r"\bmean\b", ["mean", "stand for", "signify"]),
    (r"\bshow\b", ["show", "display", "tell me", "contain", "say"]),
    (r"\bGPU\b", ["GPU", "graphics card", "video card", "CUDA card", "accelerator"]),
    (r"\bthe CPU\b", ["the CPU", "the processor", "a CPU"]),
    (r"\bthe app\b", ["the app", "this app", "the application", "the web UI", "this tool",
                      "the program", "the server", "the chat app"]),
    (r"\bmodel\b", ["model", "LLM", "language model"]),
    (r"\bmemory\b", ["memory", "VRAM", "RAM"]),
    (r"\bpassword\b", ["password", "login", "credentials", "passphrase"]),
    (r"\bshare\b", ["share", "publish", "expose", "open up"]),
    (r"\bonline\b", ["online", "on the internet", "on the web", "publicly"]),
    (r"\bswitch\b", ["switch", "change", "swap"]),
    (r"\bchange\b", ["change", "switch", "modify", "set"]),
    (r"\bmodes\b", ["modes", "precisions", "dtypes", "quantization options", "formats"]),
    (r"\bmode\b", ["mode", "precision", "dtype", "format"]),
    (r"\bstop\b", ["stop", "cancel", "abort", "halt", "interrupt", "end"]),
    (r"\breply\b", ["reply", "answer", "response", "generation", "output"]),
    (r"\bfine-tune\b", ["fine-tune", "train", "finetune", "teach", "customize"]),
    (r"\btrain\b", ["train", "fine-tune", "teach"]),
    (r"\brun\b", ["run", "start", "launch", "execute"]),
    (r"\bspeed\b", ["speed", "throughput", "latency", "performance"]),
    (r"\bfast\b", ["fast", "quick", "slow"]),
    (r"\bnetwork\b", ["network", "LAN", "local network", "intranet", "wifi"]),
    (r"\brefresh\b", ["refresh", "update", "redraw", "poll"]),
    (r"\boften\b", ["often", "frequently"]),
    (r"\bweights\b", ["weights", "parameters", "tensors"]),
    (r"\bparameter\b", ["parameter", "weight"]),
    (r"\blogged\b", ["logged", "stored", "saved", "recorded", "kept"]),
    (r"\btests\b", ["tests", "test suite", "unit tests", "checks"]),
    (r"\bbrowser\b", ["browser", "web page", "GUI"]),
    (r"\bshell\b", ["shell", "terminal", "console", "bash"]),
    (r"\bfriend\b", ["friend", "coworker", "teammate", "customer"]),
    (r"\bquality\b", ["quality", "accuracy", "precision"]),
    (r"\bclient\b", ["client", "SDK", "library"]),
    (r"\bchats\b", ["chats", "conversations", "dialogues"]),
    (r"\bChat\b", ["Chat", "Talk"]),
    (r"\bfree\b", ["free", "release", "reclaim", "clear"]),
    (r"\bcards\b", ["cards", "panels", "boxes"]),
    (r"\bresults\b", ["results", "numbers", "figures", "measurements"]),
]
# Words that carry no topic: a keyword-style question is a seed without them.
STOPWORDS = set("""a an the i me my you your it its this that is are am be was do does did
can could should would will how what which who where when why if of to in on for with from at
by about there here any some and or so just please""".split())
# Shapes a keyword-style question is asked in: shared by every topic, so that the shape of a
# question says nothing about its topic and the model must read the content words.
FRAMES = ["{}", "{}?", "Tell me about {}", "Question about {}", "Help with {}", "Info on {}",
          "What about {}?", "I have a question on {}", "Something on {} please", "Explain {}",
          "{} - how?", "{} help", "Any tips on {}?", "I am stuck with {}", "Details on {}"]
FILLERS = ["actually", "exactly", "again", "here", "really", "now", "please", "quickly"]
_COMPILED = [(re.compile(pattern), alternatives) for pattern, alternatives in SYNONYMS]


def _swap_synonyms(question: str, rng: random.Random) -> str:
    for pattern, alternatives in _COMPILED:
        question = pattern.sub(
            lambda m, alts=alternatives: rng.choice(alts) if rng.random() < 0.5 else m.group(0),
            question)
    return question


def _lower_first(text: str) -> str:
    """'What is' -> 'what is', but 'API' and 'CLI' keep their capitals."""
    return text if text[1:2].isupper() else text[0].lower() + text[1:]


def _surface(question: str, rng: random.Random) -> str:
    """Case, punctuation, an opener in front or a closer behind: what a chat box gets."""
    roll = rng.random()
    if roll < 0.25:
        question = _lower_first(question)
    elif roll < 0.35:
        question = question.lower()
    if rng.random() < 0.25:
        question = question.rstrip("?.!")
    if rng.random() < 0.3:
        question = rng.choice(OPENERS) + _lower_first(question)
    if rng.random() < 0.2:
        question = question + rng.choice(CLOSERS)
    return question


def _keywords(question: str) -> str:
    words = [w.strip("?,.!:") for w in question.split()]
    kept = [w for w in words if w and w.lower() not in STOPWORDS]
    return " ".join(kept) or question


def _perturb(question: str, rng: random.Random) -> str:
    """One word left out or one filler word put in: the answer must not hang on every word."""
    words = question.split()
    if len(words) >= 4 and rng.random() < 0.5:
        del words[rng.randrange(len(words))]
    else:
        words.insert(rng.randrange(len(words) + 1), rng.choice(FILLERS))
    return " ".join(words)


def _variant(seed: str, rng: random.Random) -> str:
    question = _swap_synonyms(seed, rng)
    roll = rng.random()
    if roll < 0.3:
        question = rng.choice(FRAMES).format(_keywords(question))
    elif roll < 0.55:
        question = _perturb(question, rng)
    return _surface(question, rng)


def wordings(phrasings: list[str], count: int, rng: random.Random) -> list[str]:
    """`count` distinct wordings: the seeds as written first, then varied ones."""
    seen = dict.fromkeys(phrasings)
    for _ in range(count * 20):
        if len(seen) >= count:
            break
        seen.setdefault(_variant(rng.choice(phrasings), rng))
    return list(seen)[:count]


def _reply(answer: str, reasoning: str | None) -> str:
    return f"<think>\n{reasoning}\n</think>\n\n{answer}" if reasoning else answer


def _replies(answer: str, reasoning: str | None, rng: random.Random) -> str:
    """With reasoning half the time where the topic has some (Thinking on), else the answer."""
    return _reply(answer, reasoning) if reasoning and rng.random() < 0.5 else answer


def conversations(seed: int = SEED) -> list[dict]:
    rng = random.Random(seed)
    asked = [wordings(phrasings, SINGLE_PER_TOPIC + FOLLOW_UPS_PER_TOPIC, rng)
             for phrasings, _, _ in TOPICS]
    out = []
    for index, (_, answer, reasoning) in enumerate(TOPICS):
        questions = asked[index]
        for question in questions[:SINGLE_PER_TOPIC]:
            messages = [{"role": "user", "content": question},
                        {"role": "assistant", "content": _replies(answer, reasoning, rng)}]
            if rng.random() < 0.15:
                messages.insert(0, {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
            out.append({"messages": messages})
        for question in questions[SINGLE_PER_TOPIC:]:
            # One or two earlier turns on other topics (their answers as the history holds
            # them: without reasoning), then this topic's question.
            history = []
            for other in rng.sample([i for i in range(len(TOPICS)) if i != index],
                                    rng.choice((1, 2))):
                history += [{"role": "user", "content": rng.choice(asked[other])},
                            {"role": "assistant", "content": TOPICS[other][1]}]
            out.append({"messages": history + [
                {"role": "user", "content": question},
                {"role": "assistant", "content": _replies(answer, reasoning, rng)}]})
    rng.shuffle(out)
    return out


def write(path: Path = DATA_FILE) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in conversations()))
    return path


if __name__ == "__main__":
    written = write()
    print(f"wrote {written} ({written.stat().st_size / 1024:.0f} KB)")
