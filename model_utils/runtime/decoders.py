"""One reply decoded alone: prefill(ids) -> logits[V]; step(token) -> logits[V].

EagerDecoder runs the model's own forward on a dynamic KV cache that grows each step, which is
what plain model.generate does and works everywhere (CPU, offloaded placements, bitsandbytes).
generation.decode_tokens drives it: for models the batch runner cannot batch (their layer types
or attention implementation, kv_cache.support), and as the reference the tests compare the
batched path with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel


def input_device(model: PreTrainedModel) -> torch.device:
    """Where input ids must go: the embedding's device (the first device of a split model)."""
    weight = model.get_input_embeddings().weight
    if weight.device.type == "meta":  # offloaded to disk: accelerate's hooks move it in
        return torch.device("cpu")
    return weight.device


class EagerDecoder:
    """A dynamic cache that grows each step (what plain model.generate uses)."""

    name = "eager"

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.device = input_device(model)
        self.sample_device = self.device
        self.cache: DynamicCache | None = None
        self.position = 0

    @torch.inference_mode()
    def prefill(self, input_ids: list[int], *, max_new_tokens: int) -> torch.Tensor:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)
        self.position = ids.shape[1]
        out = self.model(input_ids=ids, position_ids=torch.arange(self.position,
                         device=self.device)[None], cache=self.cache, use_cache=True,
                         logits_to_keep=1)
        return out.logits[0, -1].to(self.sample_device)

    @torch.inference_mode()
    def step(self, token: int) -> torch.Tensor:
        ids = torch.tensor([[token]], dtype=torch.long, device=self.device)
        positions = torch.tensor([[self.position]], device=self.device)
        self.position += 1
        out = self.model(input_ids=ids, position_ids=positions, cache=self.cache,
                         use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].to(self.sample_device, copy=True)
