"""Flash varlen attention for packed training rows computes what sdpa with the block mask
computes: the same loss and the same LoRA gradients, and no example sees another."""

from __future__ import annotations

import pytest
import torch

from model_utils.training.data import IGNORE, Example, pack_batch
from model_utils.training.models import TokenLoss, load_for_training
from model_utils.training.packed_attention import available, use_packed_varlen
from tests.gpu.conftest import gpu_marks

pytestmark = gpu_marks()

SHAPE = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 256,
         "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8,
         "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 1024,
         "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("packed-attention") / "model"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**SHAPE), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def _examples(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, SHAPE["vocab_size"], (n,), generator=g).tolist()
        out.append(Example(ids, [IGNORE] * (n // 4) + ids[n // 4:]))
    return out


def _loss_and_grads(folder, batch, varlen: bool, method: str = "lora"):
    torch.manual_seed(1)  # the same LoRA initialisation for both
    model = load_for_training(folder, method, device=torch.device("cuda"))
    if varlen:
        use_packed_varlen(model)
    loss_module = TokenLoss(model, varlen=varlen)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        total, count = loss_module(**batch)
    (total / count).backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return (total / count).item(), grads


@pytest.mark.parametrize("method", ["lora", "qlora"])  # qlora: fp32 norms feed the attention
def test_varlen_matches_the_block_masked_sdpa(tiny_folder, method):
    if not available(torch.device("cuda")):
        pytest.skip("this torch has no torch.nn.attention.varlen")
    examples = _examples([100, 37, 250, 9])
    rows = [Example(sum((e.input_ids for e in examples[:2]), []),
                    sum((e.labels for e in examples[:2]), []),
                    sum((list(range(len(e.input_ids))) for e in examples[:2]), [])),
            Example(sum((e.input_ids for e in examples[2:]), []),
                    sum((e.labels for e in examples[2:]), []),
                    sum((list(range(len(e.input_ids))) for e in examples[2:]), []))]
    batch = {k: v.cuda() for k, v in pack_batch(rows, pad_id=0).items()}  # row 0 gets pads
    sdpa_loss, sdpa_grads = _loss_and_grads(tiny_folder, batch, False, method)
    varlen_loss, varlen_grads = _loss_and_grads(tiny_folder, batch, True, method)
    assert varlen_loss == pytest.approx(sdpa_loss, rel=1e-2)
    assert sdpa_grads.keys() == varlen_grads.keys() and sdpa_grads
    for name, grad in sdpa_grads.items():
        other = varlen_grads[name]
        if grad.norm() == 0:
            continue
        cosine = torch.nn.functional.cosine_similarity(grad.flatten(), other.flatten(), dim=0)
        assert cosine > 0.99, (name, float(cosine))


def test_varlen_keeps_examples_apart(tiny_folder):
    """The last example's loss packed behind others equals its loss alone."""
    if not available(torch.device("cuda")):
        pytest.skip("this torch has no torch.nn.attention.varlen")
    first, last = _examples([200, 120], seed=3)
    packed = Example(first.input_ids + last.input_ids,
                     [IGNORE] * len(first.labels) + last.labels,
                     list(range(len(first.input_ids))) + list(range(len(last.input_ids))))
    alone = Example(last.input_ids, last.labels, list(range(len(last.input_ids))))
    packed_loss, _ = _loss_and_grads(tiny_folder, {k: v.cuda() for k, v in
                                                   pack_batch([packed], 0).items()}, True)
    alone_loss, _ = _loss_and_grads(tiny_folder, {k: v.cuda() for k, v in
                                                  pack_batch([alone], 0).items()}, True)
    assert packed_loss == pytest.approx(alone_loss, rel=1e-2)
