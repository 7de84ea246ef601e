"""The demo model's training data: short conversations about this app, written out as JSONL.

    python -m model_utils.loading.demo_chats            # rewrites model_utils/loading/data/demo_chats.jsonl

Each topic is a few hand-written phrasings of one question and one answer; every phrasing is
used as written and once more in a varied form (lower case, a greeting in front, ...). Then come
the topic's other wordings (data/demo_wordings.json: seventy to ninety a topic, more for the
off-topic questions; everyday words, keyword queries, longer conversational questions, some with
topic-free words around them), and the topic asked after one to five other topics' turns. A share
of each kind, and every phrasing once more, comes after a common system prompt ("Be brief.",
"You are a helpful assistant.", ...). Topics with a
`reasoning` line put it in the assistant's <think> block, so the Thinking switch shows real
reasoning with the demo model. The output is deterministic (a fixed seed): the demo model's cache
is keyed by the file's hash, and a test checks that the committed file is what this writes.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DATA_FILE = Path(__file__).with_name("data") / "demo_chats.jsonl"
# More wordings of each topic's question, the way users ask (everyday words, keyword queries),
# keyed by the topic's first phrasing: the model can only map a word to a topic if it saw it.
WORDINGS_FILE = DATA_FILE.with_name("demo_wordings.json")
SEED = 7
# How many times each topic is asked after other topics' turns, and how many turns come before
# it (weighted): a conversation in the app runs on for several turns. GREETING_FIRST_SHARE of
# them open with the greeting, PHRASING_LAST_SHARE ask one of the topic's own phrasings last.
FOLLOW_UPS = 24
HISTORY_TURNS = (1, 2, 3, 4, 5)
HISTORY_WEIGHTS = (3, 3, 2, 2, 1)
GREETING_FIRST_SHARE = 0.3
PHRASING_LAST_SHARE = 0.3

GREETING = ("Hello! I am the tiny demo model of this app. Ask me about the modes, the memory "
            "cards, sharing, the benchmark or the command line.")
OFF_TOPIC = ("Sorry, I cannot answer that: I only know about this app. For anything else, pick a "
             "real model in the Model tab and press Load.")

# (phrasings, answer, reasoning or None)
TOPICS: list[tuple[list[str], str, str | None]] = [
    (["Hello", "Hi", "Hey there", "Good morning", "Hi, who is there?"], GREETING, None),
    (["Who are you?", "What are you?", "Are you a real model?", "What model is this?"],
     "I am a tiny demo model, trained in about a minute on questions about this app. Load a "
     "real model in the Model tab for real answers.", None),
    (["How are you?", "How are you doing today?", "How is it going?"],
     "I am fine, thank you. I am a tiny demo model, so I only know about this app.", None),
    (["Thank you", "Thanks a lot", "Thanks, that helps"],
     "You are welcome! Ask me anything else about the app.", None),
    (["Bye", "Goodbye", "See you later"], "Goodbye! Have a nice day.", None),
    (["What can you do?", "What do you know?", "How can you help me?", "Help"],
     "I can answer questions about this app: the precision modes, how to switch them, the "
     "memory cards, safe sharing, the benchmark and the command line.", None),
    # Questions about anything else: an honest "I don't know" rather than an app answer.
    (["What is the capital of France?", "Write me a poem", "What's the weather tomorrow?",
      "Tell me a joke", "Can you help me with my homework?"],
     OFF_TOPIC, None),
    (["Why is the demo model so small?", "Why are your answers so short?",
      "Why do you only know about this app?"],
     "I am a tiny model with about a million weights, built on first use in about a minute on "
     "the CPU. I learned only about fifty questions about this app, each asked many ways.",
     "The user asks why I am small. I was trained in about a minute on the CPU, so I can only "
     "be tiny and know little."),
    # -- modes ---------------------------------------------------------------------------------
    (["What modes are there?", "Which modes can I choose?", "What are the modes?",
      "What do the modes mean?", "List the precision modes"],
     "The modes are fp32, bf16, fp16, int4-wo, int8-wo, fp8, int8, nf4, nf4-dq, fp4 and "
     "fp4-dq. They set how many bytes each weight takes in memory.", None),
    (["What is fp32?", "What does fp32 mean?", "Tell me about the fp32 mode"],
     "fp32 is full precision: 4 bytes per parameter. It is the most exact mode and the "
     "largest one.", None),
    (["What is bf16?", "What does bf16 mean?", "Tell me about the bf16 mode"],
     "bf16 is the 16-bit brain float: 2 bytes per parameter, with the range of fp32 and less "
     "precision. It is the usual mode on a GPU.", None),
    (["What is fp16?", "What does fp16 mean?", "Tell me about the fp16 mode"],
     "fp16 is 16-bit half precision: 2 bytes per parameter. It has more precision than bf16 "
     "but a smaller range.", None),
    (["What is the difference between bf16 and fp16?", "bf16 or fp16?",
      "Should I use bf16 or fp16?"],
     "Both take 2 bytes per parameter. bf16 keeps the range of fp32, fp16 keeps more digits; "
     "bf16 is the safer choice for large models.",
     "Both are 16 bits. bf16 has 8 exponent bits like fp32, fp16 has more mantissa bits. "
     "Overflow is the bigger risk, so bf16."),
    (["What is int4-wo?", "What does int4-wo mean?", "Tell me about the int4-wo mode",
      "What is int4 weight-only?"],
     "int4-wo is int4 weight-only: the app quantizes a bf16 checkpoint as it loads, one bf16 "
     "scale and zero point per 128 weights, about 0.53 bytes per parameter. On a GPU, "
     "gemlite's kernels decode one reply faster than bf16.", None),
    (["What is int8-wo?", "What does int8-wo mean?", "Tell me about the int8-wo mode",
      "What is int8 weight-only?"],
     "int8-wo is int8 weight-only, with one scale per output row: about 1 byte per parameter, "
     "half of bf16. The app quantizes the weights as it loads.", None),
    (["What is fp8?", "What does fp8 mean?", "Tell me about the fp8 mode", "What is e4m3?"],
     "fp8 stores the weights as 8-bit floats (e4m3) with one scale per output row: 1 byte per "
     "parameter. It is the least exact 8-bit mode.", None),
    (["What is int8?", "What does int8 mean?", "Tell me about the int8 mode",
      "What is LLM.int8?"],
     "int8 is LLM.int8 from bitsandbytes: about 1 byte per parameter. Outlier features stay in "
     "16 bits, so the quality holds up well.", None),
    (["What is nf4?", "What does nf4 mean?", "Tell me about the nf4 mode",
      "What is 4-bit NormalFloat?"],
     "nf4 is 4-bit NormalFloat from bitsandbytes: about half a byte per parameter. Its levels "
     "follow the normal distribution of the weights.", None),
    (["What is fp4?", "What does fp4 mean?", "Tell me about the fp4 mode"],
     "fp4 is a plain 4-bit float from bitsandbytes: about half a byte per parameter, usually a "
     "little less exact than nf4.", None),
    (["What does -dq mean?", "What is nf4-dq?", "What is double quantization?",
      "What is fp4-dq?"],
     "The -dq modes add double quantization: the scales of the 4-bit blocks are quantized too, "
     "which saves about 0.4 bits per parameter.", None),
    (["Which mode should I pick?", "Which mode is best?", "What mode should I use?",
      "Which mode do you recommend?"],
     "Use bf16 when the model fits on your GPU. If it does not, try int8-wo, which halves the "
     "memory, then int4-wo, which needs about a third of it.",
     "The best mode depends on memory. bf16 is exact enough and fast, int8-wo halves it, "
     "int4-wo takes about a third. So start with bf16 and go down only if it does not fit."),
    (["How much memory does a 7B model need?", "How big is a 7B model?",
      "Will a 7B model fit on my GPU?"],
     "About 15 GB in bf16, 8 GB in int8-wo and 5 GB in int4-wo, plus the KV cache. The Model "
     "tab shows the estimate before you load.",
     "7 billion parameters times the bytes per parameter: 2 in bf16, about 1 in int8-wo, "
     "about half a byte in int4-wo."),
    (["What is the compute dtype?", "What does compute dtype mean?"],
     "The compute dtype is the type the 4-bit modes compute in after unpacking the weights. "
     "bf16 is the default; change it under Advanced in the Model tab.", None),
    # -- switching -----------------------------------------------------------------------------
    (["How do I switch modes?", "How do I change the mode?", "How can I switch to nf4?",
      "How do I switch the precision?", "How do I change the precision mode?"],
     "Open the Model tab, pick a mode and press Load. The old model is unloaded first, and if "
     "the new load fails it comes back.", None),
    (["What happens if a load fails?", "What if the new model does not load?",
      "What if the switch fails?"],
     "The previous model is loaded again, same mode and same placement, and the page says why "
     "the new one failed.", None),
    (["How do I load another model?", "How do I load a real model?", "How do I pick a model?"],
     "Pick it in the model list of the Model tab, or type a folder path or a hub id, then "
     "press Load.", None),
    (["What is the placement?", "What does placement mean?", "Where do the weights go?"],
     "The placement says where the weights go: the cpu, one GPU, or the auto, balanced and "
     "sequential strategies of accelerate.", None),
    (["Can I switch while a reply is streaming?", "What if I switch during a reply?"],
     "A switch waits for the replies in flight to end, holds new ones back meanwhile, and says "
     "so if it takes too long.", None),
    (["How do I unload the model?", "How do I free the memory?"],
     "Press Unload in the Model tab. The page then says whether all the memory came back.",
     None),
    # -- memory --------------------------------------------------------------------------------
    (["What do the memory cards show?", "What is on the memory cards?",
      "What does the Memory tab show?", "Explain the memory cards"],
     "Each card shows one GPU: the memory used out of the total from NVML, and what torch has "
     "allocated and reserved. Below them are the CPU RAM and this process.", None),
    (["What is the difference between allocated and reserved?", "What does reserved mean?",
      "What is allocated memory?"],
     "Allocated is the memory tensors use now. Reserved is what torch keeps from the GPU, "
     "allocated plus cached free blocks, so it is never smaller.",
     "Allocated counts live tensors. Reserved counts what the caching allocator took from the "
     "GPU, including the free blocks it keeps for later."),
    (["What if I have no GPU?", "Does it work without a GPU?", "Can I run it on the CPU?"],
     "Yes. Without a GPU every mode runs on the CPU, slowly, and the Memory tab shows the CPU "
     "RAM and this process.", None),
    (["How often do the cards refresh?", "What does the memory plot show?"],
     "The cards refresh every 2 seconds, and the plot shows the last five minutes.", None),
    (["What is RSS?", "What does process RSS mean?"],
     "RSS is the memory of this process in RAM. It drops after an unload, when the weights are "
     "freed.", None),
    # -- sharing -------------------------------------------------------------------------------
    (["How do I share the app safely?", "How do I share it?", "How can I share the app?",
      "How do I make a public link?", "Is sharing safe?"],
     "Start with --share and at least one --auth user:password. Add --admin with one user, so "
     "that only that user may load or switch models.",
     "A public link is open to anyone who has it, so it needs a login, and model changes "
     "should be for one user only."),
    (["What if I use --share without --auth?", "Can I share without a password?"],
     "The app refuses: --share without --auth prints a message and exits with status 2 before "
     "anything is loaded.", None),
    (["What does --admin do?", "What is the admin user?", "Who may load models?"],
     "--admin USER lets only that logged-in user load, unload or switch models and train. "
     "Every other login may still chat.", None),
    (["What does --auth do?", "How do I add a login?", "How do I add users?"],
     "--auth user:password adds a login for the page and the API. Repeat it for more users, or "
     "use --auth-file with one user:password a line.", None),
    (["Can I bind to 0.0.0.0?", "How do I serve on my network?"],
     "Yes, with --host 0.0.0.0, but any address other than 127.0.0.1 also needs --auth, the "
     "same as --share.", None),
    # -- benchmark -----------------------------------------------------------------------------
    (["How do I run the benchmark?", "How do I benchmark a model?",
      "How can I measure the speed?", "How do I run the bench?"],
     "Open the Benchmark tab and press Run benchmark, or run python -m model_utils.bench "
     "--model demo --modes bf16,nf4 on the command line.", None),
    (["What does the benchmark measure?", "What does the Benchmark tab show?"],
     "It measures the time to first token and the tokens per second of this app's decode path, "
     "and compares them with plain model.generate on the same weights.", None),
    (["Where are the benchmark results?", "Where are the measured figures?"],
     "The bench command prints a table and writes JSON with --out and a chart. Measured "
     "figures are in BENCHMARKS.md.", None),
    (["What is the fast path?", "Why is the GPU so fast?"],
     "On a CUDA GPU replies decode together in a paged KV cache, through CUDA graphs. On the "
     "CPU the eager path is used.", None),
    # -- command line and the rest -------------------------------------------------------------
    (["What does the CLI do?", "Is there a command line?", "How do I chat without a browser?",
      "What is python -m model_utils chat?"],
     "python -m model_utils chat loads a model and streams one reply to the terminal, with no "
     "browser. python -m model_utils prompt prints the prompt the model receives.", None),
    (["How do I get JSON from the CLI?", "What does --json do?"],
     "Add --json to chat to get one JSON object at the end, with the text, the token counts "
     "and the timings.", None),
    (["How do I fine-tune a model?", "How do I train an adapter?", "How do I fine-tune?"],
     "Run python -m model_utils.finetune --model demo --data chats.jsonl --out "
     "models/my-adapter, or use the Train tab.", None),
    (["What does the Train tab do?", "What is the Train tab?"],
     "The Train tab fine-tunes a model on a JSONL file of chats, shows the loss curve live, and "
     "puts the adapter in the model list.", None),
    (["How do I start the app?", "How do I run the app?", "How do I install it?"],
     "Run ./start.sh. The first run sets up the virtual environment, then the app serves on "
     "http://127.0.0.1:7860.", None),
    (["What is the Thinking switch?", "What does Thinking do?", "What is thinking mode?"],
     "The Thinking switch lets a Qwen3 model reason in a think block before it answers. The "
     "reasoning is shown apart from the answer.",
     "The user asks about the switch. When it is on, the model writes its reasoning first, "
     "like this."),
    (["Is there an OpenAI API?", "Can I use an OpenAI client?"],
     "Yes: POST /v1/chat/completions speaks the OpenAI chat format, so any OpenAI client can "
     "use the loaded model.", None),
    (["Where are the logs?", "Are my prompts logged?"],
     "Logs go to server.log. Prompts and replies are not logged unless you start the app with "
     "--log-prompts.", None),
    (["How do I run the tests?", "How do I test the app?"],
     "Run ./test.sh. It runs everything on the CPU with the demo model.", None),
    (["What does Stop do?", "How do I stop a reply?"],
     "Stop ends the reply within one decode step. Closing the tab does the same.", None),
]

# System prompts that say nothing about the topic, so that the model learns to look past them:
# on SYSTEM_SHARE of the topics' phrasings and wordings (and every phrasing once more), and
# FOLLOW_UP_SYSTEM_SHARE of the follow-ups (the common ones users and clients send, such as the
# API docs' "Be brief.").
SYSTEM_PROMPTS = ["You are a helpful assistant.", "Be brief.", "You answer questions about "
                  "this app.", "You are a helpful assistant. Answer concisely.", "Be concise.",
                  "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
                  "Answer in one or two sentences.", "You are a friendly assistant.",
                  "Keep your answers short and clear."]
SYSTEM_SHARE = 0.2
FOLLOW_UP_SYSTEM_SHARE = 0.3
OPENERS = ["Hi! ", "Hello, ", "Quick question: ", "Please tell me: ", "Hey, "]
# Words around a question that say nothing about its topic, so that the model learns to look
# past them: users' questions come with such padding, the wordings mostly without.
FILLER_OPENERS = ["I'm new here. ", "Sorry if this is a silly question, but ", "Quick one: ",
                  "I was wondering, ", "On my laptop, ", "Can you help? ", "Hi, ", "OK so ",
                  "Question: ", "I am a bit lost. ", "Hey, quick question. ", "Please explain: ",
                  "I have a question. ", "So, "]
FILLER_CLOSERS = [" please", " Thanks in advance.", " I'm a bit lost.", " for my project?",
                  " Any idea?", " I could not find it.", " Thank you!", " in this app",
                  " here?", " Just curious."]
FILLER_SHARE = 0.4


def _vary(question: str, rng: random.Random) -> str:
    """A close paraphrase: lower case, no question mark, or an opener in front."""
    lowered = question[0].lower() + question[1:]
    choice = rng.randrange(4)
    if choice == 0:
        return lowered.rstrip("?")
    if choice == 1:
        return rng.choice(OPENERS) + lowered
    if choice == 2:
        return question + " Thanks!"
    return question.rstrip("?").upper() if len(question) < 20 else lowered


def _with_filler(question: str, rng: random.Random) -> str:
    """The question as written, or (FILLER_SHARE of the time) with topic-free words around it."""
    roll = rng.random()
    if roll < FILLER_SHARE / 2:
        return rng.choice(FILLER_OPENERS) + question[0].lower() + question[1:]
    if roll < FILLER_SHARE:
        return question.rstrip("?.!") + rng.choice(FILLER_CLOSERS)
    return question


def _with_system(messages: list[dict], share: float, rng: random.Random) -> list[dict]:
    """The messages, `share` of the time after one of SYSTEM_PROMPTS."""
    if rng.random() < share:
        return [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] + messages
    return messages


def _reply(answer: str, reasoning: str | None) -> str:
    return f"<think>\n{reasoning}\n</think>\n\n{answer}" if reasoning else answer


def conversations(seed: int = SEED) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for phrasings, answer, reasoning in TOPICS:
        reply = _reply(answer, reasoning)
        for question in phrasings:
            turns = [(question, reply), (_vary(question, rng), reply)]
            if reasoning:
                # The same question answered without reasoning: what follows the empty think
                # block that the template puts in the prompt when Thinking is off. The reasoning
                # once more, so that it stays what Thinking on brings (most wordings of every
                # other topic teach the empty block).
                turns += [(question, answer), (question, reply)]
            for text, content in turns:
                messages = [{"role": "user", "content": text},
                            {"role": "assistant", "content": content}]
                out.append({"messages": _with_system(messages, SYSTEM_SHARE, rng)})
            # And once after a system prompt: a short question ("Hello") is then the smaller
            # part of the prompt, and must still be answered as without one.
            out.append({"messages": _with_system([{"role": "user", "content": question},
                                                  {"role": "assistant", "content": answer}],
                                                 1.0, rng)})
    wordings = json.loads(WORDINGS_FILE.read_text())
    # Half of a reasoning topic's wordings with the reasoning: with Thinking on, the model
    # writes it after the topic's own phrasings (two in three of them have it there), and with
    # Thinking off the answer still follows the empty think block for the other half.
    for phrasings, answer, reasoning in TOPICS:
        for question in wordings[phrasings[0]]:
            content = _reply(answer, reasoning if rng.random() < 0.5 else None)
            messages = [{"role": "user", "content": _with_filler(question, rng)},
                        {"role": "assistant", "content": content}]
            out.append({"messages": _with_system(messages, SYSTEM_SHARE, rng)})
    # Each topic asked after one to five other topics' turns, so that the question asked last
    # is answered and not one from the history, however long the history. A share of them open
    # with the greeting, as chats in the app do, and a share ask one of the topic's own
    # phrasings last: the history must not turn the plain question into another topic.
    for index, (phrasings, answer, reasoning) in enumerate(TOPICS):
        for _ in range(FOLLOW_UPS):
            turns = rng.choices(HISTORY_TURNS, HISTORY_WEIGHTS)[0]
            greet = index != 0 and rng.random() < GREETING_FIRST_SHARE
            skip = {index, 0} if greet else {index}
            others = ([TOPICS[0]] if greet else []) + rng.sample(
                [t for i, t in enumerate(TOPICS) if i not in skip], turns - greet)
            messages = [m for other, other_answer, _ in others for m in (
                {"role": "user", "content": rng.choice(other + wordings[other[0]])},
                {"role": "assistant", "content": other_answer})]
            asked = phrasings if rng.random() < PHRASING_LAST_SHARE else wordings[phrasings[0]]
            messages += [{"role": "user", "content": rng.choice(asked)},
                         {"role": "assistant", "content": answer}]
            out.append({"messages": _with_system(messages, FOLLOW_UP_SYSTEM_SHARE, rng)})
    rng.shuffle(out)
    return out


def write(path: Path = DATA_FILE) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in conversations()))
    return path


if __name__ == "__main__":
    written = write()
    print(f"wrote {written} ({written.stat().st_size / 1024:.0f} KB)")
