"""A trained adapter (model_utils.finetune's output) applied to its base model at load."""

from __future__ import annotations

import torch


def apply_adapter(model: torch.nn.Module, folder, *, merge: bool) -> torch.nn.Module:
    """The base model with a peft adapter applied. Merged into the weights where the mode
    allows (fp32/bf16/fp16: the result is a plain model, so the fast decode path applies as to
    any other); on bitsandbytes weights it stays a separate LoRA branch beside each quantized
    layer (merging would round the sum to 4 or 8 bits). Either way the transformers model
    itself is returned, not peft's wrapper, so the engine sees the same classes as ever."""
    from peft import PeftModel

    wrapped = PeftModel.from_pretrained(model, folder, is_trainable=False)
    return wrapped.merge_and_unload() if merge else wrapped.get_base_model()
