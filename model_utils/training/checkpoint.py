"""What a run leaves behind: the resumable checkpoint, the output folder, and its manifest.

OUT/                      the result: an adapter folder (adapter_config.json + weights) or,
                          for --method full, a whole model folder; the tokenizer beside it
OUT/finetune.json         the manifest (base model, method, data hash, steps, final loss)
OUT/train_log.jsonl       one line per optimizer step (loss, tokens/s): what the Train tab plots
OUT/checkpoint/           written every --save-every steps and on Ctrl-C / SIGTERM; --resume
                          continues from it; removed once the run completes

A checkpoint holds only what trains (the LoRA matrices, or every weight for --method full),
the optimizer and scheduler states and the RNG states. The data order needs no state: it is a
function of the seed and the step (data.Schedule).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from model_utils.training.manifest import MANIFEST, MANIFEST_FORMAT

from .models import load_trainable_state, trainable_state

TRAIN_LOG = "train_log.jsonl"
CHECKPOINT = "checkpoint"


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def save_checkpoint(out: Path, *, model, optimizer, scheduler, state: dict) -> Path:
    """Write OUT/checkpoint atomically (a half-written one never replaces a good one)."""
    final = out / CHECKPOINT
    tmp = out / (CHECKPOINT + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(trainable_state(model), tmp / "trainable.safetensors")
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "rng": rng}, tmp / "optimizer.pt")
    write_json_atomic(tmp / "state.json", {**state, "saved_at": time.time()})
    old = out / (CHECKPOINT + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(out: Path, *, model, optimizer, scheduler) -> dict:
    """Restore a checkpoint into the (prepared) model/optimizer/scheduler; its state.json."""
    folder = out / CHECKPOINT
    state = json.loads((folder / "state.json").read_text())
    load_trainable_state(model, load_file(folder / "trainable.safetensors"))
    saved = torch.load(folder / "optimizer.pt", weights_only=False, map_location="cpu")
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    torch.set_rng_state(saved["rng"]["torch"])
    random.setstate(saved["rng"]["python"])
    if "cuda" in saved["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["rng"]["cuda"])
    return state


# What a run continued from a checkpoint must share with the run that wrote it: with another
# rank the saved matrices do not fit (a raw tensor-size error), with other data or settings
# the run would go on silently as a different run under the same name.
RESUME_FIELDS = {"model_path": "the base model", "method": "the method",
                 "lora_r": "the LoRA rank", "max_len": "max tokens",
                 "batch_size": "the batch size", "grad_accum": "grad accumulation",
                 "packing": "packing", "seed": "the seed"}


def checkpoint_state(out: Path) -> dict:
    """The checkpoint's state.json ({} if it cannot be read)."""
    try:
        state = json.loads((Path(out) / CHECKPOINT / "state.json").read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return state if isinstance(state, dict) else {}


def resume_differences(state: dict, now: dict) -> list[str]:
    """What differs between the run a checkpoint was written for (its state.json) and `now`
    (the same keys as TrainConfig, and data_sha256 where known), as phrases for a message."""
    saved = state.get("config") if isinstance(state.get("config"), dict) else {}
    differences = []
    for key, what in RESUME_FIELDS.items():
        if key in saved and key in now and not _same(key, saved[key], now[key]):
            if key == "model_path":
                differences.append(f"{what} ({Path(str(saved[key])).name} then, "
                                   f"{Path(str(now[key])).name} now)")
            else:
                differences.append(f"{what} ({saved[key]} then, {now[key]} now)")
    if key_differs(state, now, "data_sha256"):
        differences.append("the data (the file's content is not the one it trained on)")
    return differences


def key_differs(saved: dict, now: dict, key: str) -> bool:
    return bool(saved.get(key)) and bool(now.get(key)) and saved[key] != now[key]


def _same(key: str, saved, now) -> bool:
    if key == "model_path":
        return Path(str(saved)).resolve() == Path(str(now)).resolve()
    return saved == now


def has_checkpoint(out: Path) -> bool:
    return (out / CHECKPOINT / "state.json").is_file()


def remove_checkpoint(out: Path) -> None:
    shutil.rmtree(out / CHECKPOINT, ignore_errors=True)


def read_train_log(out: str | Path) -> list[dict]:
    """Every step logged so far (a line being written is skipped)."""
    path = Path(out) / TRAIN_LOG
    rows = []
    try:
        lines = path.read_text().split("\n")
    except OSError:
        return rows
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def trim_train_log(out: Path, last_step: int) -> None:
    """Drop logged steps after the checkpoint being resumed: they will be run again."""
    path = out / TRAIN_LOG
    rows = [r for r in read_train_log(out) if r.get("step", 0) <= last_step]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def save_output(out: Path, *, model, tokenizer, manifest: dict) -> None:
    """The trained folder: the adapter (or full model), the tokenizer, and the manifest last
    (the registry lists a folder only once its manifest is there)."""
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:  # None: a benchmark on token ids
        tokenizer.save_pretrained(out)
    write_json_atomic(out / MANIFEST, {"format": MANIFEST_FORMAT, **manifest})
