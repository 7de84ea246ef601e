"""`python -m model_utils`: chat (streamed and --json), prompt, and refusals of bad input.

Each case runs the CLI as a user would, in its own process; the processes start together
(a few seconds each, most of it importing torch) and the tests read their results.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from model_utils.chat.prompt import render_prompt
from model_utils.chat.reasoning import ReasoningSplitter
from model_utils.cli import StreamPrinter

from .helpers import REPO_ROOT

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello!"},
    {"role": "user", "content": "What is the capital of France?"},
]
# nf4, so that bitsandbytes is imported and loaded: its notices must not reach stderr either.
GREEDY = ["--model", "demo", "--mode", "nf4", "--placement", "cpu", "--prompt", "Hello",
          "--max-new-tokens", "12", "--temperature", "0", "--system", "Be terse."]
JSON_KEYS = {"text", "reasoning", "new_tokens", "ttft_ms", "tok_s", "mode", "placement", "model",
             "prompt_tokens", "decode_path", "finish_reason"}


def _cases(folder) -> dict[str, list[str]]:
    conv = folder / "conv.json"
    conv.write_text(json.dumps(CONVERSATION))
    (folder / "wrapped.json").write_text(json.dumps({"messages": CONVERSATION}))
    (folder / "broken.json").write_text('[{"role": "user", "content": ')
    (folder / "object.json").write_text('{"role": "user", "content": "hi"}')
    (folder / "robot.json").write_text('[{"role": "robot", "content": "hi"}]')
    (folder / "number.json").write_text('[{"role": "user", "content": 123}]')
    (folder / "surrogate.json").write_text('[{"role": "user", "content": "bad \\ud800"}]')
    cases = {
        "chat --json": ["chat", *GREEDY, "--json"],
        "chat streamed": ["chat", *GREEDY],
        "prompt": ["prompt", "--model", "demo", "--messages", str(conv)],
        "prompt wrapped, no thinking, system": [
            "prompt", "--messages", str(folder / "wrapped.json"), "--no-thinking",
            "--system", "You are a pirate."],
        # Refusals: exit 2, one line on stderr.
        "unknown model": ["chat", "--model", "nope", "--prompt", "hi"],
        "uncached hub id": ["chat", "--model", "acme/not-downloaded", "--prompt", "hi"],
        # A folder named on the command line is the operator's choice: allowed, and read.
        "a folder that is no model": ["chat", "--model", "/etc", "--prompt", "hi"],
        "a model folder named directly": ["prompt", "--model", str(folder / "my-model"),
                                          "--messages", str(conv)],
        "dot-dot out of models_dir": ["prompt", "--models-dir", str(folder), "--model",
                                      "sub/../../..", "--prompt", "hi"],
        "unknown mode": ["chat", "--mode", "int3", "--prompt", "hi"],
        "negative temperature": ["chat", "--prompt", "hi", "--temperature", "-1"],
        "max_new_tokens over the context": ["chat", "--prompt", "hi", "--mode", "fp32",
                                            "--placement", "cpu", "--context-tokens", "64",
                                            "--max-new-tokens", "5000", "--json"],
        "tiny temperature": ["chat", "--prompt", "hi", "--mode", "fp32", "--placement", "cpu",
                             "--temperature", "2.28e-39", "--max-new-tokens", "4", "--json"],
        "huge seed": ["chat", "--prompt", "hi", "--seed", str(2**70)],
        "negative max_new_tokens": ["chat", "--prompt", "hi", "--max-new-tokens", "-5"],
        "huge temperature": ["chat", "--prompt", "hi", "--temperature", "1e300"],
        "content a number": ["prompt", "--messages", str(folder / "number.json")],
        "lone surrogate in a file": ["prompt", "--messages", str(folder / "surrogate.json")],
        "undecodable argument": ["prompt", "--prompt", b"caf\xff"],
        "not a number": ["chat", "--prompt", "hi", "--temperature", "warm"],
        "bad JSON": ["prompt", "--messages", str(folder / "broken.json")],
        "missing file": ["prompt", "--messages", str(folder / "missing.json")],
        "not a list": ["prompt", "--messages", str(folder / "object.json")],
        "unknown role": ["prompt", "--messages", str(folder / "robot.json")],
        "no command": [],
    }
    return cases


@pytest.fixture(scope="module")
def runs(tmp_path_factory, demo_path) -> dict[str, subprocess.CompletedProcess]:
    folder = tmp_path_factory.mktemp("cli")
    copy = folder / "my-model"  # outside every allowed folder; the tokenizer is all prompt reads
    copy.mkdir()
    for file in demo_path.iterdir():
        if file.is_file() and not file.name.endswith(".safetensors"):
            shutil.copy(file, copy / file.name)
    cases = _cases(folder)

    # One torch thread per process: two processes at a time on two cores then take half the
    # wall time of one after the other, where two threads each made it slower than serial.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def run(argv):
        return subprocess.run([sys.executable, "-m", "model_utils", *argv], cwd=REPO_ROOT,
                              env=env, capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 2))) as pool:
        return dict(zip(cases, pool.map(run, cases.values())))


def _ok(result) -> None:
    assert result.returncode == 0, result.stderr


def test_chat_json_has_the_keys(runs):
    result = runs["chat --json"]
    _ok(result)
    assert result.stderr == ""
    reply = json.loads(result.stdout)  # the whole of stdout is one JSON object
    assert JSON_KEYS <= reply.keys()
    assert (reply["mode"], reply["placement"], reply["model"]) == ("nf4", "cpu", "demo")
    assert reply["new_tokens"] <= 12 and reply["prompt_tokens"] > 0
    assert reply["finish_reason"] in ("length", "eos")
    assert reply["decode_path"] == "eager"
    assert reply["settings"]["temperature"] == 0.0
    assert reply["ttft_ms"] > 0 and reply["tok_s"] >= 0


def test_chat_streams_the_same_reply_with_a_clean_stderr(runs):
    streamed, whole = runs["chat streamed"], json.loads(runs["chat --json"].stdout)
    _ok(streamed)
    # No loading bars, library warnings (bitsandbytes' kernel notice) or logs.
    assert streamed.stderr == ""
    expected = (f"<think>\n{whole['reasoning']}\n</think>\n\n" if whole["reasoning"] else "")
    expected += whole["text"]
    assert streamed.stdout == (expected if expected.endswith("\n") else expected + "\n")


def test_prompt_prints_exactly_the_rendered_prompt(runs, demo_tokenizer):
    result = runs["prompt"]
    _ok(result)
    assert result.stdout == render_prompt(demo_tokenizer, CONVERSATION)
    assert result.stderr == ""


def test_a_model_folder_named_directly_is_read(runs, demo_tokenizer):
    result = runs["a model folder named directly"]
    _ok(result)
    assert result.stdout == render_prompt(demo_tokenizer, CONVERSATION)


def test_prompt_with_system_and_thinking_off(runs, demo_tokenizer):
    result = runs["prompt wrapped, no thinking, system"]
    _ok(result)
    expected = render_prompt(demo_tokenizer, CONVERSATION, system_prompt="You are a pirate.",
                             thinking=False)
    assert result.stdout == expected
    assert expected.endswith("<think>\n\n</think>\n\n") and "pirate" in expected


REFUSALS = {
    "unknown model": "neither a folder path, a hub id nor 'demo'",
    "uncached hub id": "not in the local Hugging Face cache",
    "a folder that is no model": "'/etc' has no config.json",
    "dot-dot out of models_dir": "outside the allowed model folders",
    "unknown mode": "unknown mode 'int3'",
    "negative temperature": "temperature: must be >= 0 and <= 100, got -1.0",
    "huge seed": "seed: must be >= 0 and <= 9223372036854775807, got 1180591620717411303424",
    "negative max_new_tokens": "max_new_tokens: must be at least 1, got",
    "huge temperature": "temperature: must be >= 0 and <= 100",
    "content a number": "message 0: content must be text, got a number",
    "lone surrogate in a file": "message 0 contains an invalid character",
    "undecodable argument": "message 0 contains an invalid character",
    "not a number": "argument --temperature: invalid float value: 'warm'",
    "bad JSON": "is not valid JSON",
    "missing file": "cannot read messages file",
    "not a list": "must hold a non-empty JSON list",
    "unknown role": "unknown role 'robot'",
    "no command": "required",
}


@pytest.mark.parametrize("case", REFUSALS)
def test_bad_input_exits_2_with_one_line(runs, case):
    result = runs[case]
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert REFUSALS[case] in lines[0]
    assert "9223372036854775807" not in lines[0] or case == "huge seed"


def test_a_reply_longer_than_the_context_leaves_is_clamped_not_refused(runs):
    result = runs["max_new_tokens over the context"]
    _ok(result)
    reply = json.loads(result.stdout)
    assert reply["context_tokens"] == 64
    assert reply["prompt_tokens"] + reply["new_tokens"] <= 64
    assert "The reply is limited to" in reply["notice"] and "asked: 5000" in reply["notice"]


def test_a_tiny_temperature_is_greedy_and_runs(runs):
    result = runs["tiny temperature"]
    _ok(result)
    reply = json.loads(result.stdout)
    assert reply["finish_reason"] in ("length", "eos") and reply["new_tokens"] <= 4


@pytest.fixture(scope="module")
def random_model(tmp_path_factory, demo_path):
    """The demo model's shape with random weights: its replies go on for thousands of tokens
    (the trained demo model ends its replies within a second)."""
    import torch
    from transformers import AutoTokenizer

    from model_utils.loading.demo_model import _build_model

    folder = tmp_path_factory.mktemp("models") / "random"
    tokenizer = AutoTokenizer.from_pretrained(demo_path)
    tokenizer.save_pretrained(folder)
    model = _build_model(tokenizer)
    # Zero logits for the end tokens: a greedy reply never ends, whatever the random weights
    # (the largest of the other logits is above zero).
    with torch.no_grad():
        for token in ("<|im_end|>", "<|endoftext|>"):
            model.lm_head.weight[tokenizer.convert_tokens_to_ids(token)] = 0
    model.save_pretrained(folder)
    return folder


def test_ctrl_c_mid_reply_exits_130_cleanly(random_model):
    """Ctrl-C while the worker thread is decoding: exit 130 with one line, no crash (exiting
    under a forward pass in progress ended in SIGABRT / SIGSEGV)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "model_utils", "chat", "--mode", "fp32", "--placement", "cpu",
         "--models-dir", str(random_model.parent), "--model", str(random_model),
         "--prompt", "hi", "--max-new-tokens", "4000", "--temperature", "0"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        # A suite started in the background (`./test.sh &`) has SIGINT ignored, and a child
        # inherits that: Ctrl-C is given its default meaning back, as in a terminal.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.read(1), "no reply started"  # decoding is under way
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.decode() == "\ninterrupted\n"


# -- the streamed display, in-process -------------------------------------------------------------
class _Out:
    def __init__(self):
        self.writes: list[str] = []

    def write(self, text):
        self.writes.append(text)

    def flush(self):
        pass


def _stream(texts: list[str]) -> str:
    """What StreamPrinter writes for a reply whose text grows through `texts` (each the one
    before plus a piece), split as the engine splits it."""
    out = _Out()
    printer = StreamPrinter(out)
    splitter, before = ReasoningSplitter(), ""
    for text in texts:
        assert text.startswith(before)
        delta = splitter.feed(text[len(before):])
        printer.update(delta.reasoning, delta.answer, resplit=delta.resplit)
        before = text
    last = splitter.finish()
    printer.update(last.reasoning, last.answer, done=True, resplit=last.resplit)
    return "".join(out.writes)


def test_stream_marks_the_reasoning_and_never_takes_text_back():
    reply = "<think>\nFirst this.\n\nThen that.\n</think>\n\nThe answer.\n\nDone."
    # Every prefix at a character boundary except inside the (single-token) tags.
    cuts = [i for i in range(1, len(reply) + 1)
            if not any(reply.find(tag) < i < reply.find(tag) + len(tag)
                       for tag in ("<think>", "</think>"))]
    shown = _stream([reply[:i] for i in cuts])
    assert shown == "<think>\nFirst this.\n\nThen that.\n</think>\n\nThe answer.\n\nDone.\n"


def test_stream_of_a_plain_answer_and_of_unfinished_reasoning():
    assert _stream(["Hel", "Hello", "Hello there"]) == "Hello there\n"
    assert _stream(["<think>\nstill", "<think>\nstill going\n"]) == \
        "<think>\nstill going\n</think>\n\n"
    assert _stream(["", "<think>"]) == ""  # nothing to show yet, not even a newline


def test_stream_survives_a_stray_close_tag():
    # Random weights can emit </think> after answer text; the split then changes under the
    # printer. It goes on from where the versions differ instead of stalling or crashing.
    shown = _stream(["abc", "abc</think>", "abc</think>def"])
    assert shown.startswith("abc") and shown.endswith("def\n")
