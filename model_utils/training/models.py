"""The model being trained: the base checkpoint loaded for one method, and the loss module the
training loop runs.

full  : every weight trains, in fp32 (the optimizer's master copy; autocast does the bf16 math).
lora  : the base is frozen (bf16 on a GPU, fp32 on the CPU) and peft adds LoRA matrices to every
        linear layer of the decoder (and to the output layer of a model under 100M parameters).
qlora : the base is loaded in bitsandbytes nf4 (double quantized, bf16 compute), its other
        weights frozen in bf16, and peft adds the same LoRA matrices (the QLoRA paper's recipe).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .data import IGNORE
from .defaults import SMALL_MODEL
from .packed_attention import varlen_kwargs

Method = Literal["lora", "qlora", "full"]
METHODS: tuple[str, ...] = ("lora", "qlora", "full")

log = logging.getLogger(__name__)


class MethodUnavailable(RuntimeError):
    """This method cannot run on this machine (the message says why and what to use)."""


def qlora_unavailable_reason(device: torch.device) -> str:
    if device.type != "cuda":
        # bitsandbytes 0.50 runs 4-bit inference on the CPU, but its CPU path has no backward
        # through the quantized matmul that QLoRA needs; refuse before loading anything.
        return ("--method qlora needs a CUDA GPU (bitsandbytes 4-bit training has no CPU "
                "backward); use --method lora on the CPU")
    return ""


def load_for_training(path: str | Path, method: Method, *, device: torch.device,
                      lora_r: int = 16, lora_alpha: int | None = None,
                      lora_dropout: float = 0.0, gradient_checkpointing: bool = False,
                      trust_remote_code: bool = False) -> nn.Module:
    """The model ready to train with `method` (peft-wrapped for lora/qlora)."""
    from transformers import AutoModelForCausalLM

    kwargs: dict = {"use_safetensors": True, "trust_remote_code": trust_remote_code}
    if method == "qlora":
        if reason := qlora_unavailable_reason(device):
            raise MethodUnavailable(reason)
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)
        kwargs["dtype"] = torch.bfloat16
        kwargs["device_map"] = {"": device.index or 0}
    elif method == "lora" and device.type == "cuda":
        kwargs["dtype"] = torch.bfloat16  # frozen: no master copy needed
        kwargs["device_map"] = {"": device.index or 0}  # straight to the GPU, not via the CPU
    else:
        kwargs["dtype"] = torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    model.config.use_cache = False  # a KV cache is useless (and costs memory) in training
    if method == "full":
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        return model
    from peft import LoraConfig, get_peft_model

    if method == "qlora":
        # What peft's prepare_model_for_kbit_training does, less its upcast of every
        # non-quantized weight to fp32: those (norms, embeddings, lm_head: 4.4 GB in fp32 on
        # the 7B shape) never train, and in bf16 they cost half the memory and keep the
        # residual stream in bf16, as with --method lora. Measured faster (benchmarks/HISTORY.md).
        for parameter in model.parameters():
            parameter.requires_grad = False
    if gradient_checkpointing:
        # Non-reentrant checkpointing needs no enable_input_require_grads (peft's note).
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    config = LoraConfig(r=lora_r, lora_alpha=lora_alpha or 2 * lora_r, lora_dropout=lora_dropout,
                        target_modules=lora_targets(model), task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def lora_targets(model: nn.Module) -> str | list[str]:
    """peft's "all-linear" (every linear layer but the output layer), and on a small model the
    output layer too. A small model's output rows for words it never produced in training
    stay far below the rest, and LoRA on the decoder alone cannot lift them: the demo model's
    loss on four new facts stopped at 2.07 whatever the rank, rate or steps, each new word at
    about 1 % (BENCHMARKS.md, fine-tuning). A big model's vocabulary is trained, and its output
    layer (vocabulary x hidden) would be the largest one adapted. A tied output layer is the
    input embeddings too: left as peft's default."""
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    if head is None or tied or sum(p.numel() for p in model.parameters()) >= SMALL_MODEL:
        return "all-linear"
    head_name = next(name for name, module in model.named_modules() if module is head)
    decoder = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and module is not head}
    return sorted(decoder) + [head_name]


def keep_input_dtype(model: nn.Module) -> None:
    """Under autocast, let peft's LoRA layers take their input as it comes (bf16).

    peft casts each LoRA layer's input to the adapter's fp32 before lora_A, and autocast casts it
    straight back to bf16 for the matmul: two copies of every adapted activation, forward and
    backward, for an identical result (its gain was measured together with best-fit packing,
    BENCHMARKS.md's fine-tuning section, not apart). Set once, not per call, so that activation
    checkpointing recomputes exactly what the forward computed.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.cast_input_dtype_enabled = False


def causal_lm_parts(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(decoder stack, lm_head) of a causal LM, peft-wrapped or not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder(), base.get_output_embeddings()


# 16 M values: 64 MB of fp32 logits, and as much again for their gradient.
UNCHUNKED_LOGITS = 1 << 24


class TokenLoss(nn.Module):
    """Summed next-token cross-entropy over labelled tokens, and how many there were.

    The loop divides by the token count of the whole (all-process) micro-batch, so the
    gradient is the mean over every assistant token whatever the batch is split into. The
    vocabulary projection runs in chunks under activation checkpointing: a 152k-entry vocabulary
    makes full logits of 4096 tokens cost 2.5 GB in fp32 (and as much again for their
    gradient), while one chunk at a time costs a fraction of it.
    """

    def __init__(self, model: nn.Module, *, chunk_tokens: int = 1024, varlen: bool = False):
        super().__init__()
        self.model = model
        self.chunk_tokens = chunk_tokens
        self.varlen = varlen  # packed batches go through packed_attention (flash varlen)

    def forward(self, input_ids, labels, attention_mask=None, position_ids=None):
        decoder, head = causal_lm_parts(self.model)
        extra = {}
        if self.varlen and position_ids is not None and attention_mask is None:
            extra = varlen_kwargs(position_ids)
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, use_cache=False, **extra).last_hidden_state
        # Position t predicts token t+1.
        hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        targets = labels[:, 1:].reshape(-1)
        keep = targets != IGNORE
        hidden, targets = hidden[keep], targets[keep]
        if targets.numel() * head.weight.shape[0] <= UNCHUNKED_LOGITS:
            return _chunk_loss(head, hidden, targets), keep.sum()
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, targets.numel(), self.chunk_tokens):
            part = slice(start, start + self.chunk_tokens)
            if torch.is_grad_enabled():
                total = total + checkpoint(_chunk_loss, head, hidden[part], targets[part],
                                           use_reentrant=False)
            else:
                total = total + _chunk_loss(head, hidden[part], targets[part])
        return total, keep.sum()


def _chunk_loss(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    return nn.functional.cross_entropy(logits, targets, reduction="sum")


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights a checkpoint must keep: only what trains (LoRA matrices, or everything)."""
    return {name: p.detach().cpu().contiguous() for name, p in model.named_parameters()
            if p.requires_grad}


def load_trainable_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    missing = [name for name, p in params.items() if p.requires_grad and name not in state]
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} trained weights "
                         f"(e.g. {missing[0]}): was it written by another --method or model?")
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)


def count_parameters(model: nn.Module) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trained, total
