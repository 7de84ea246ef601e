"""The training loop's speed choices change no number: LoRA layers that keep their bf16 input under
autocast compute the same loss and gradients as peft's default casting."""

from __future__ import annotations

import pytest
import torch

from model_utils.training.data import IGNORE, Example, pack_batch
from model_utils.training.models import TokenLoss, keep_input_dtype, load_for_training

pytestmark = pytest.mark.unit


def _loss_and_grads(demo_path, batch, keep: bool):
    torch.manual_seed(5)  # the same LoRA initialisation for both
    model = load_for_training(demo_path, "lora", device=torch.device("cpu"))
    # lora_B starts at zero, which would hide lora_A's path from the gradient check.
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    if keep:
        keep_input_dtype(model)
    loss_module = TokenLoss(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        total, count = loss_module(**batch)
    (total / count).backward()
    return total.item(), {n: p.grad.clone() for n, p in model.named_parameters()
                          if p.grad is not None}


def test_keeping_the_input_dtype_changes_nothing_under_autocast(demo_path):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 200, (48,), generator=g).tolist()
    batch = pack_batch([Example(ids, [IGNORE] * 8 + ids[8:])], pad_id=0)
    cast_loss, cast_grads = _loss_and_grads(demo_path, batch, keep=False)
    kept_loss, kept_grads = _loss_and_grads(demo_path, batch, keep=True)
    assert kept_loss == cast_loss
    assert cast_grads.keys() == kept_grads.keys() and len(cast_grads) > 4
    for name, grad in cast_grads.items():
        assert torch.equal(grad, kept_grads[name]), name


def test_packing_keeps_every_example_once_and_fills_the_rows():
    from model_utils.training.data import pack_examples

    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(256, 1025, (400,), generator=g).tolist()
    examples = [Example([i] * n, [i] * n) for i, n in enumerate(lengths)]
    rows = pack_examples(examples, max_len=1024, seed=3)
    assert all(len(r.input_ids) <= 1024 for r in rows)
    seen = sorted(token for r in rows for token in dict.fromkeys(r.input_ids))
    assert seen == list(range(400))  # every example in exactly one row, whole
    for r in rows:  # positions restart at each example
        starts = [p for p, pos in enumerate(r.positions) if pos == 0]
        assert len(starts) == len(set(r.input_ids))
    fill = sum(lengths) / (1024 * len(rows))
    assert fill > 0.9, fill  # laying them in shuffled order fills about 72 %
    assert rows == pack_examples(examples, max_len=1024, seed=3)  # deterministic


def test_small_logits_at_once_give_the_chunked_loss_and_gradients(demo_path, monkeypatch):
    """A small vocabulary's logits are computed at once, without the chunks' checkpointing:
    the loss and every gradient are those of the chunked path."""
    from model_utils.training import models

    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 200, (64,), generator=g).tolist()
    batch = pack_batch([Example(ids, [IGNORE] * 10 + ids[10:])], pad_id=0)

    def loss_and_grads(unchunked: int):
        monkeypatch.setattr(models, "UNCHUNKED_LOGITS", unchunked)
        torch.manual_seed(5)
        model = load_for_training(demo_path, "full", device=torch.device("cpu"))
        total, count = TokenLoss(model, chunk_tokens=16)(**batch)
        (total / count).backward()
        return total.item(), {n: p.grad for n, p in model.named_parameters()}

    chunked_loss, chunked = loss_and_grads(0)
    whole_loss, whole = loss_and_grads(1 << 24)
    assert whole_loss == pytest.approx(chunked_loss, rel=1e-5)
    for name, grad in chunked.items():
        torch.testing.assert_close(whole[name], grad, rtol=1e-4, atol=1e-6, msg=name)
