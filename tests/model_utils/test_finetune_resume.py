"""Continuing a run from its checkpoint with another rank, other data or other settings is
refused with a plain message naming what differs: by the fine-tuning command (--resume) and,
before it starts, by the Train tab's runner (a Start under the same name continues)."""

from __future__ import annotations

import json
import re

import pytest

from model_utils.finetune.runner import TrainingRunner, TrainRefused, TrainRequest
from model_utils.loading.registry import ModelRegistry

from .test_finetune import QA, finetune, losses, write_qa

EXCEPTION = re.compile(r"\b[A-Z][A-Za-z]*(Error|Exception)\b|Traceback|size mismatch")


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A models folder with a run stopped at step 2 of 6 (rank 4), and its data."""
    models = tmp_path_factory.mktemp("models")
    data = write_qa(models / "qa.jsonl")
    out = models / "run"
    stopped = finetune("--model", "demo", "--data", str(data), "--out", str(out), "--steps",
                       "6", "--batch-size", "2", "--lora-r", "4", "--stop-after", "2",
                       check=False)
    assert stopped.returncode == 130, stopped.stderr
    return models, data, out


def resume(out, data, *extra):
    return finetune("--model", "demo", "--data", str(data), "--out", str(out), "--steps", "6",
                    "--batch-size", "2", "--resume", *extra, check=False)


@pytest.mark.parametrize(("change", "words"), [
    (["--lora-r", "8"], "the LoRA rank (4 then, 8 now)"),
    (["--lora-r", "4", "--max-len", "64"], "max tokens (1024 then, 64 now)"),
    (["--lora-r", "4", "--other-data"], "the data (the file's content is not the one"),
], ids=["other-rank", "other-max-len", "other-data"])
def test_resume_with_another_run_is_refused_saying_what_differs(stopped_run, tmp_path,
                                                                change, words):
    _models, data, out = stopped_run
    if "--other-data" in change:
        change = [c for c in change if c != "--other-data"]
        data = tmp_path / "other.jsonl"
        data.write_text("".join(json.dumps({"messages": [
            {"role": "user", "content": q}, {"role": "assistant", "content": a + " Really."}]})
            + "\n" for q, a in QA))
    refused = resume(out, data, *change)
    assert refused.returncode != 0
    assert words in refused.stderr, refused.stderr[-2000:]
    last = refused.stderr.strip().splitlines()[-1]
    assert not EXCEPTION.search(last), last
    assert (out / "checkpoint").exists() and len(losses(out)) == 2  # nothing lost


def test_the_runner_refuses_a_start_that_would_continue_another_run(stopped_run):
    models, data, out = stopped_run
    runner = TrainingRunner(ModelRegistry(models), output_dir=models)
    request = TrainRequest(model="demo", data=data, name=out.name, steps=6, batch_size=2,
                           lora_r=8)
    with pytest.raises(TrainRefused) as refused:
        runner.start(request)
    message = str(refused.value)
    assert "another run" in message and "the LoRA rank (4 then, 8 now)" in message, message
    assert str(models) not in message
    assert runner.job is None  # nothing started


def test_resume_with_the_same_run_goes_on(stopped_run):
    _models, data, out = stopped_run
    resumed = resume(out, data, "--lora-r", "4")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert len(losses(out)) == 6
