"""The embedded demo model: a tiny Qwen3-architecture checkpoint built offline on first use.

No weights can be downloaded, so the app, its tests and its first run use a model it makes itself:
a byte-level BPE tokenizer trained on the text of the demo conversations (model_utils/data), a
Qwen3 config a few MB in size initialised with a fixed seed, and Qwen3's own ChatML chat template
with the thinking switch. That model is then trained on the demo conversations by the project's
own fine-tuning loop (model_utils.finetune, method full, fixed seed, on the CPU: about a minute
on two cores), so that it answers questions about the app in sentences. The result is written
with save_pretrained and loaded through exactly the same from_pretrained path as a real checkpoint.
The build is cached, keyed by the recipe version and the data file's hash.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from .load_stages import Progress

DEMO_NAME = "demo"
DEMO_LABEL = "demo model (tiny, trained on questions about this app)"
# Bump when the recipe changes so an old cached build is not reused.
DEMO_VERSION = 5
SEED = 1234
# The training run of the build (BENCHMARKS.md, "The demo model", has the recipes tried): rows
# of ROW_TOKENS tokens packed with whole examples, TRAIN_BATCH rows a step. Two layers: a step
# costs half of four's, and more steps over more wordings taught more than depth did. Recipe 5:
# follow-ups of up to five earlier turns (whole replies, never cut) in rows of 384 tokens, so
# that the positions of a five-turn chat are trained; three rows a step, 2 400 steps.
LAYERS = 2
TRAIN_STEPS = 2400
TRAIN_BATCH = 3
ROW_TOKENS = 384
TRAIN_LR = 1.5e-3
# Most single-turn examples end REPLY_TOKENS_CUT tokens into the answer: the answer's first
# tokens pick the topic, and the rest of it is learned from the whole ones. A cut example costs
# half a whole one, so the same time sees twice the wordings. Follow-ups are never cut.
CUT_SHARE = 0.8
REPLY_TOKENS_CUT = 7
# Two threads where there are two cores: the build takes about two thirds of one thread's time
# there. More do not help a 128-wide model, and threads that wait on each other on a machine
# busy with other work were measured far slower than one.
BUILD_THREADS = min(2, os.cpu_count() or 1)
# How often the console says how far the build is when it has no progress bar (not a tty).
REPORT_EVERY = 25

log = logging.getLogger(__name__)

_TEMPLATE = Path(__file__).with_name("templates") / "qwen3.jinja"

# Plain text for the tokenizer's merges, beside the demo conversations: common English pieces
# become single tokens so that prompts are a realistic number of tokens long.
_CORPUS = """
The quick brown fox jumps over the lazy dog. Hello, how are you today? I am fine, thank you.
A language model predicts the next token from the tokens before it. Large models are slow when
memory bandwidth is the limit: every generated token reads every weight once. Quantization to
eight or four bits makes the weights smaller, so more of them fit and each token reads less.
Please write a short poem about the sea. Explain why the sky is blue. What is the capital of
France? Paris is the capital of France. Summarize this text in one sentence. Translate to German.
def main():\n    print("hello world")\n    return 0\nfor i in range(10):\n    total += i * 2
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14 2.71 42. Dates: 2026-11-29, Monday, January.
Let me think step by step. First, we consider the question. Then we answer it clearly.
"""

VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen3 keeps these as added but not "special" tokens, so they survive skip_special_tokens and
# the reasoning can be split from the answer in the decoded text.
THINK_TOKENS = ["<think>", "</think>"]


def default_cache_dir() -> Path:
    root = os.environ.get("QWEN_CHAT_CACHE") or Path.home() / ".cache" / "qwen-chat"
    return Path(root)


def demo_data_file() -> Path:
    from .demo_chats import DATA_FILE

    return DATA_FILE


def _demo_folder(cache_dir: Path) -> Path:
    """Where this version of the demo, trained on this data, is kept."""
    from model_utils.training.data import file_sha256

    return cache_dir / f"demo-qwen3-v{DEMO_VERSION}-{file_sha256(demo_data_file())[:12]}"


def demo_model_path(cache_dir: Path | None = None, progress: Progress | None = None) -> Path:
    """Path of the demo checkpoint, building it first if it is not there yet; `progress`
    (a load's (fraction, message) callback) hears the build's steps."""
    target = _demo_folder(cache_dir or default_cache_dir())
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename into place: two processes starting at once both
    # build, the first rename wins, and nobody ever sees a half-written folder.
    tmp = Path(tempfile.mkdtemp(prefix=".demo-build-", dir=target.parent))
    try:
        _build(tmp, progress)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("built the demo model at %s", target)
    return target


def demo_tokenizer():
    """The demo model's tokenizer without its training: what a random benchmark model needs,
    built from the demo data in about a second (training the model takes minutes on a machine
    that has not built it yet). The built demo's own copy is read where there is one."""
    from transformers import AutoTokenizer

    from model_utils.training.data import read_conversations

    built = _demo_folder(default_cache_dir())
    if (built / "config.json").exists():
        return AutoTokenizer.from_pretrained(built)
    return _build_tokenizer(read_conversations(demo_data_file()))


def _build(folder: Path, progress: Progress | None = None) -> None:
    """Initialise the tiny model, then train it on the demo conversations into `folder`."""
    import time

    import torch

    from model_utils.training.data import read_conversations, tokenize_conversations
    from model_utils.training.train import TrainConfig, run

    start = time.perf_counter()
    conversations = read_conversations(demo_data_file())
    print(f"building the demo model: training a tiny model on {len(conversations)} "
          "conversations about this app (about a minute on two CPU cores, once; cached in "
          f"{folder.parent})", file=sys.stderr, flush=True)
    base = folder / "init"
    tokenizer = _build_tokenizer(conversations)
    tokenizer.save_pretrained(base)
    _build_model(tokenizer).save_pretrained(base, safe_serialization=True)
    # The loss on each conversation's last reply only: the earlier turns of a follow-up are
    # other topics' examples already, and repeating them would cost steps.
    examples = [tokenize_conversations(tokenizer, [c], max_len=ROW_TOKENS)[-1]
                for c in conversations]
    single_turn = [sum(m["role"] == "user" for m in c) == 1 for c in conversations]
    examples = _cut_most_replies(examples, single_turn,
                                 tokenizer.convert_tokens_to_ids("</think>"))
    config = TrainConfig(model_path=str(base), model_name="demo (initialised)",
                         data=str(demo_data_file()), out=str(folder), method="full",
                         steps=TRAIN_STEPS, batch_size=TRAIN_BATCH, lr=TRAIN_LR,
                         warmup_steps=10, seed=SEED, cpu=True, packing=True,
                         max_len=ROW_TOKENS, fused_cpu_adamw=True,
                         handle_signals=False, progress=sys.stderr.isatty(),
                         extra_manifest={"demo_version": DEMO_VERSION})
    threads = torch.get_num_threads()
    torch.set_num_threads(BUILD_THREADS)
    try:
        result = run(config, examples, tokenizer, on_step=_step_reporter(progress))
    finally:
        torch.set_num_threads(threads)
    shutil.rmtree(base, ignore_errors=True)
    print(f"built the demo model in {time.perf_counter() - start:.0f} s (loss "
          f"{result.losses[0]:.2f} -> {result.final_loss:.3f})", file=sys.stderr, flush=True)


def _cut_most_replies(examples, single_turn: list[bool], think_end: int):
    """CUT_SHARE of the single-turn examples (a fixed choice) end REPLY_TOKENS_CUT tokens after
    the think block (empty or not) that starts each reply. A follow-up keeps its whole reply:
    its history costs far more than the reply, and the answer's later tokens must be learned
    after a long history too."""
    import random

    from model_utils.training.data import IGNORE, Example

    rng = random.Random(SEED)
    out = []
    for example, single in zip(examples, single_turn, strict=True):
        if rng.random() < CUT_SHARE and single:
            start = next(i for i, label in enumerate(example.labels) if label != IGNORE)
            answer = example.input_ids.index(think_end, start) + 1
            end = answer + REPLY_TOKENS_CUT
            example = Example(example.input_ids[:end], example.labels[:end])
        out.append(example)
    return out


def _step_reporter(progress: Progress | None):
    """The train loop's step callback: the load's progress (the Model tab's stage text) at
    every step, the console every REPORT_EVERY steps unless tqdm draws its bar there."""
    console = not sys.stderr.isatty()

    def on_step(done: int, steps: int, loss: float) -> None:
        message = f"building the demo model: step {done}/{steps} (loss {loss:.2f})"
        if progress is not None:
            # Between the load's "resolving" (0.1) and its tokenizer (0.2).
            progress(0.1 + 0.1 * done / steps, message)
        if console and (done % REPORT_EVERY == 0 or done == steps):
            print(message, file=sys.stderr, flush=True)

    return on_step


def _build_tokenizer(conversations: list[list[dict]]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AddedToken, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes: no <unk>
        show_progress=False,
    )
    texts = [m["content"] for conversation in conversations for m in conversation]
    bpe.train_from_iterator([_CORPUS] * 4 + texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    tokenizer.chat_template = _TEMPLATE.read_text()
    return tokenizer


def _build_model(tokenizer):
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=eos_ids[1],
        eos_token_id=eos_ids[0],
        pad_token_id=eos_ids[1],
        dtype="bfloat16",
    )
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    # Qwen3's published sampling defaults, so "defaults come from generation_config" is shown
    # by the demo model exactly as by a real one.
    model.generation_config = GenerationConfig(
        do_sample=True, temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.0,
        eos_token_id=eos_ids, pad_token_id=eos_ids[1], bos_token_id=eos_ids[1],
        max_new_tokens=512,
    )
    return model
