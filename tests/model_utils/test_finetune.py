"""The fine-tuning command on the CPU: bad data refused by line, the loss falls, a trained adapter
answers its questions through the chat CLI, two processes follow one process with the doubled
batch, and an interrupted run resumes on the same loss curve.

Everything trains LoRA on the demo model (1M weights) for a few dozen steps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from model_utils.training.data import DataError, read_conversations

ROOT = Path(__file__).resolve().parents[2]
# One thread per process: these models are too small to gain from two, and on a shared 2-core
# machine two threads per process were measured 10x slower than one.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# Questions the demo model was never trained on, with answers it cannot know.
QA = [("What is the secret word?", "The secret word is pineapple."),
      ("Who painted the blue door?", "Maria painted the blue door in May."),
      ("Where is the red key?", "The red key is under the third stone."),
      ("How many lamps are lit?", "Seven lamps are lit tonight.")]


def write_qa(path: Path) -> Path:
    path.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n"
        for q, a in QA))
    return path


def finetune(*args: str, launcher: list[str] | None = None, timeout: float = 600,
             check: bool = True) -> subprocess.CompletedProcess:
    command = (launcher or [sys.executable]) + ["-m", "model_utils.finetune", *args,
                                                "--no-progress"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                            timeout=timeout, env=ENV, check=False)
    if check and result.returncode != 0:
        raise AssertionError(f"finetune exited {result.returncode}:\n{result.stderr[-3000:]}")
    return result


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "train_log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def qa_file(tmp_path_factory, demo_path) -> Path:
    return write_qa(tmp_path_factory.mktemp("data") / "qa.jsonl")


@pytest.fixture(scope="module")
def qa_adapter(tmp_path_factory, qa_file) -> Path:
    """The demo model with a LoRA adapter trained on QA (in a models folder)."""
    out = tmp_path_factory.mktemp("models") / "qa-adapter"
    finetune("--model", "demo", "--data", str(qa_file), "--out", str(out), "--steps", "100",
             "--lr", "5e-3", "--batch-size", "4", "--lora-r", "16")
    return out


@pytest.mark.parametrize("content, message", [
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]}'
     '\n\n{not json\n', ":3: not valid JSON"),
    ('{"messages": [{"role": "user", "content": "hi"}]}\n', ":1: no assistant turn"),
    ('{"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}]}',
     ":1: message 0 has unknown role 'robot'"),
    ("\n  \n", "has no conversations (it is empty)"),
    ('{"messages": "hello"}\n', ':1: expected an object with a non-empty "messages" list'),
])
def test_bad_lines_are_refused_with_their_line_number(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DataError) as error:
        read_conversations(path)
    assert str(error.value).startswith(str(path)) and message in str(error.value)


def test_the_command_refuses_bad_data_before_loading(tmp_path):
    path = tmp_path / "bad.jsonl"
    write_qa(path)
    path.write_text(path.read_text() + '{"messages": [{"role": "user", "content": "no"}]}\n')
    result = finetune("--model", "demo", "--data", str(path), "--out", str(tmp_path / "o"),
                      check=False)
    assert result.returncode == 2
    assert f"{path}:5: no assistant turn" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "o").exists()


def test_loss_on_assistant_tokens_only(demo_tokenizer):
    from model_utils.training.data import IGNORE, tokenize_conversations

    conversation = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": QA[0][0]},
                    {"role": "assistant", "content": QA[0][1]}]
    (example,) = tokenize_conversations(demo_tokenizer, [conversation], max_len=256)
    trained = [t for t, label in zip(example.input_ids, example.labels) if label != IGNORE]
    text = demo_tokenizer.decode(trained)
    # The reply (Qwen3's empty think block, the answer, the end of turn) and nothing else.
    assert text.strip().endswith(QA[0][1] + "<|im_end|>")
    assert "secret word?" not in text and "Be brief" not in text


def test_loss_falls_by_half_in_30_steps(qa_adapter):
    """Stated: LoRA steps at lr 5e-3 on 4 pairs lower the loss to under half its start, and in
    the first 30 steps already by at least a third."""
    curve = losses(qa_adapter)
    assert len(curve) == 100
    assert curve[29] < curve[0] * (2 / 3), curve[:30]
    assert curve[-1] < curve[0] / 2, curve
    # Learned, not only ranked first: LoRA on the decoder alone stopped near 2 nats a token
    # (every new word at about 1 %) until the small model's output layer was adapted too.
    assert curve[-1] < 0.1, curve[-10:]
    manifest = json.loads((qa_adapter / "finetune.json").read_text())
    assert manifest["method"] == "lora" and manifest["base_model"] == "demo"
    assert manifest["steps"] == 100 and manifest["final_loss"] == pytest.approx(curve[-1], rel=1e-5, abs=1e-6)
    assert len(manifest["data_sha256"]) == 64 and (qa_adapter / "adapter_config.json").exists()


@pytest.mark.parametrize("mode", ["bf16", "nf4"])
def test_the_adapter_answers_through_the_chat_cli(qa_adapter, mode):
    """Merged into bf16 weights, and unmerged beside nf4 weights: the trained answers, greedy."""
    question, answer = QA[0]
    result = subprocess.run(
        [sys.executable, "-m", "model_utils", "chat", "--models-dir", str(qa_adapter.parent),
         "--model", str(qa_adapter), "--mode", mode, "--placement", "cpu", "--prompt", question,
         "--temperature", "0", "--max-new-tokens", "40", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV, check=False)
    assert result.returncode == 0, result.stderr
    reply = json.loads(result.stdout)
    assert reply["text"].strip() == answer


def test_two_processes_follow_one_with_the_doubled_batch(tmp_path, qa_file):
    """accelerate launch, 2 processes on gloo with batch 2 vs one process with batch 4: the same
    examples in each step and the loss normalised over both processes' tokens, so the curves
    agree to float rounding (stated tolerance 1e-4 per step)."""
    one, two = tmp_path / "one", tmp_path / "two"
    common = ["--model", "demo", "--data", str(qa_file), "--steps", "6", "--lr", "3e-3"]
    finetune(*common, "--out", str(one), "--batch-size", "4")
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                "--dynamo_backend", "no", "--main_process_port", str(_free_port())]
    finetune(*common, "--out", str(two), "--batch-size", "2", launcher=launcher)
    assert json.loads((two / "finetune.json").read_text())["processes"] == 2
    assert losses(two) == pytest.approx(losses(one), abs=1e-4)


def test_resume_continues_the_same_loss_curve(tmp_path, qa_file):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    common = ["--model", "demo", "--data", str(qa_file), "--steps", "12", "--lr", "3e-3",
              "--batch-size", "2"]
    finetune(*common, "--out", str(whole))
    stopped = finetune(*common, "--out", str(parts), "--stop-after", "5", check=False)
    assert stopped.returncode == 130, stopped.stderr
    assert "checkpoint saved" in stopped.stderr and len(losses(parts)) == 5
    assert not (parts / "finetune.json").exists()
    finetune(*common, "--out", str(parts), "--resume")
    assert losses(parts) == pytest.approx(losses(whole), abs=1e-6)
    assert not (parts / "checkpoint").exists()  # a finished run cleans up


def test_sigterm_saves_a_checkpoint(tmp_path, qa_file):
    out = tmp_path / "long"
    process = subprocess.Popen(
        [sys.executable, "-m", "model_utils.finetune", "--model", "demo", "--data",
         str(qa_file), "--out", str(out), "--steps", "100000", "--no-progress"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.monotonic() + 300
        while not (out / "train_log.jsonl").exists() or not losses(out):
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, stderr
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["step"] >= 1 and state["steps"] == 100000


def test_qlora_on_the_cpu_is_refused_with_a_reason(tmp_path, qa_file):
    if os.environ.get("CUDA_VISIBLE_DEVICES", "") != "" and _has_cuda():
        pytest.skip("a CUDA GPU is present: qlora runs there")
    result = finetune("--model", "demo", "--data", str(qa_file), "--out", str(tmp_path / "q"),
                      "--method", "qlora", check=False)
    assert result.returncode == 2 and "qlora needs a CUDA GPU" in result.stderr


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_packed_rows_train_too(tmp_path, qa_file):
    """--packing (the four pairs in one row of 256 tokens, on the CPU the block-masked sdpa):
    the loss falls as in the padded runs, and the row is counted as one example."""
    out = tmp_path / "packed"
    finetune("--model", "demo", "--data", str(qa_file), "--out", str(out), "--steps", "30",
             "--lr", "5e-3", "--batch-size", "1", "--max-len", "256", "--packing")
    curve = losses(out)
    assert len(curve) == 30 and curve[-1] < curve[0] / 2, curve
    manifest = json.loads((out / "finetune.json").read_text())
    assert manifest["examples"] == 1 and manifest["tokens"] > 0


def test_lora_adapts_a_small_models_output_layer_unless_it_is_tied():
    from transformers import AutoModelForCausalLM, Qwen3Config

    from model_utils.training.models import lora_targets

    def tiny(tied: bool):
        return AutoModelForCausalLM.from_config(Qwen3Config(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            tie_word_embeddings=tied))

    targets = lora_targets(tiny(tied=False))
    assert targets[-1] == "lm_head"
    assert set(targets[:-1]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                 "up_proj", "down_proj"}
    assert lora_targets(tiny(tied=True)) == "all-linear"
