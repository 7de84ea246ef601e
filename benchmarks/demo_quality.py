"""How well the demo model answers: builds it into a fresh folder (or takes a built one) and
asks it, greedily in bf16 as the tests do, the held-out questions (first turn and follow-up, as
tests/model_utils/test_demo_heldout.py asks them), the validation questions (written apart
from both the training data and the held-out file), the greetings and a sample of the data's own
questions (each answered with its own answer); then checks that LoRA still teaches it four new
facts. Prints a table and writes JSON.

    python benchmarks/demo_quality.py --out benchmarks/cpu-2026-12-05/demo-quality.json
    python benchmarks/demo_quality.py --model ~/.cache/qwen-chat/demo-qwen3-v4-... --seeds 0
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HELDOUT = ROOT / "tests" / "fixtures" / "demo_heldout_questions.json"
VALIDATION = ROOT / "benchmarks" / "demo_validation_questions.json"
GREETINGS = ["hi there", "hello!", "hey", "good evening", "hiya", "Hello there!",
             "hi, anyone there?", "Hey, how is it going?", "yo", "Greetings"]
TAGS = ("<think>", "</think>")
FACTS = [("What is the secret word?", "The secret word is pineapple."),
         ("Who painted the blue door?", "Maria painted the blue door in May."),
         ("Where is the red key?", "The red key is under the third stone."),
         ("How many lamps are lit?", "Seven lamps are lit tonight.")]
FACT_STEPS = 60


def load(folder: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    return tokenizer, model


def answer(tokenizer, model, messages: list[dict]) -> str:
    import torch

    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                        enable_thinking=False, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=120, do_sample=False,
                             attention_mask=torch.ones_like(ids))
    text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    return text.split("</think>")[-1].strip()


def on_topic(text: str, keywords: list[str]) -> bool:
    return any(k.lower() in text.lower() for k in keywords)


def first_and_follow_up(tokenizer, model, questions: list[dict]) -> dict:
    """The held-out test's two measures: each question alone, then after one or two earlier
    questions with the model's own replies."""
    firsts = [answer(tokenizer, model, [{"role": "user", "content": q["question"]}])
              for q in questions]
    follow = []
    for i, question in enumerate(questions):
        earlier = [(i - k) % len(questions) for k in ((2, 1) if i % 2 else (1,))]
        history = [m for j in earlier for m in (
            {"role": "user", "content": questions[j]["question"]},
            {"role": "assistant", "content": firsts[j]})]
        follow.append(answer(tokenizer, model,
                             history + [{"role": "user", "content": question["question"]}]))
    first_miss = [(q["question"], a) for q, a in zip(questions, firsts)
                  if not on_topic(a, q["keywords"])]
    follow_miss = [(q["question"], a) for q, a in zip(questions, follow)
                   if not on_topic(a, q["keywords"])]
    tags = sum(any(t in a for t in TAGS) for a in firsts + follow)
    return {"n": len(questions), "first": len(questions) - len(first_miss),
            "follow_up": len(questions) - len(follow_miss), "tag_text": tags,
            "first_missed": first_miss, "follow_up_missed": follow_miss}


def score(folder: Path, seeds: int) -> dict:
    from model_utils.loading.demo_chats import GREETING, TOPICS

    tokenizer, model = load(folder)
    result = {"heldout": first_and_follow_up(
        tokenizer, model, json.loads(HELDOUT.read_text())["questions"])}
    if VALIDATION.exists():
        result["validation"] = first_and_follow_up(
            tokenizer, model, json.loads(VALIDATION.read_text())["questions"])
    greeted = [g for g in GREETINGS
               if answer(tokenizer, model, [{"role": "user", "content": g}]) == GREETING]
    result["greetings"] = {"n": len(GREETINGS), "right": len(greeted)}
    pairs = [(p, a) for phrasings, a, _ in TOPICS for p in phrasings]
    sample = random.Random(0).sample(pairs, min(seeds, len(pairs)))
    wrong = [p for p, a in sample
             if answer(tokenizer, model, [{"role": "user", "content": p}]) != a]
    result["seeds"] = {"n": len(sample), "right": len(sample) - len(wrong), "wrong": wrong}
    result["lora_facts"] = lora_facts(folder, tokenizer)
    return result


def lora_facts(folder: Path, tokenizer) -> dict:
    """Whether fine-tuning can teach the model: LoRA with the page's small-model learning rate
    for FACT_STEPS steps on four new facts (what the Train tab's and the CLI's tests teach it),
    then each asked greedily. A recipe once met the held-out targets and failed this."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from model_utils.training.data import tokenize_conversations
    from model_utils.training.train import TrainConfig, run

    work = Path(tempfile.mkdtemp(prefix="demo-facts-"))
    data = work / "facts.jsonl"
    conversations = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}]
                     for q, a in FACTS]
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    config = TrainConfig(model_path=str(folder), data=str(data), out=str(work / "adapter"),
                         method="lora", steps=FACT_STEPS, lr=5e-3, max_len=256, cpu=True,
                         progress=False, handle_signals=False)
    run(config, tokenize_conversations(tokenizer, conversations, max_len=256), tokenizer)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    model = PeftModel.from_pretrained(base, work / "adapter").merge_and_unload().eval()
    wrong = [q for q, a in FACTS
             if answer(tokenizer, model, [{"role": "user", "content": q}]) != a]
    return {"n": len(FACTS), "steps": FACT_STEPS, "right": len(FACTS) - len(wrong),
            "wrong": wrong}


def build(cache: Path) -> tuple[Path, float]:
    from model_utils.loading.demo_model import demo_model_path

    start = time.perf_counter()
    folder = demo_model_path(cache)
    return folder, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a built demo folder (default: build one)")
    parser.add_argument("--seeds", type=int, default=80,
                        help="how many of the data's own questions to ask (default 80)")
    parser.add_argument("--out", type=Path, help="write the JSON here")
    args = parser.parse_args()
    built_s = None
    if args.model is None:
        args.model, built_s = build(Path(tempfile.mkdtemp(prefix="demo-quality-")))
    result = {"model": args.model.name, "build_s": built_s, **score(args.model, args.seeds)}
    print(f"{'set':<12}{'first turn':>12}{'follow-up':>12}")
    for name in ("heldout", "validation"):
        if name in result:
            r = result[name]
            print(f"{name:<12}{r['first']:>8}/{r['n']:<3}{r['follow_up']:>8}/{r['n']:<3}"
                  f"  tag text: {r['tag_text']}")
    print(f"greetings {result['greetings']['right']}/{result['greetings']['n']}, data "
          f"questions {result['seeds']['right']}/{result['seeds']['n']}, new facts after "
          f"{FACT_STEPS} LoRA steps {result['lora_facts']['right']}/{result['lora_facts']['n']}, build "
          f"{built_s and f'{built_s:.0f} s'}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
