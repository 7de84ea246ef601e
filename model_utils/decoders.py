"""Decoders: how one reply's forward passes run. prefill(ids) -> logits[V]; step(token) -> logits[V].

- EagerDecoder: a dynamic KV cache that grows each step; works everywhere (CPU, offloaded
  placements, bitsandbytes). What plain model.generate does.
- StaticDecoder: a preallocated KV cache of a bucketed length; its decode step can be compiled
  into CUDA graphs (see fast_path.py) because every step then has the same shapes.
"""

from __future__ import annotations

import torch


def input_device(model) -> torch.device:
    """Where input ids must go: the embedding's device (the first device of a split model)."""
    weight = model.get_input_embeddings().weight
    if weight.device.type == "meta":  # offloaded to disk: accelerate's hooks move it in
        return torch.device("cpu")
    return weight.device


class EagerDecoder:
    name = "eager"

    def __init__(self, model):
        self.model = model
        self.device = input_device(model)
        self.sample_device = self.device
        self.cache = None
        self.position = 0

    @torch.inference_mode()
    def prefill(self, input_ids: list[int], *, max_new_tokens: int) -> torch.Tensor:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)
        self.position = ids.shape[1]
        return self._forward(ids, torch.arange(self.position, device=self.device)[None])

    @torch.inference_mode()
    def step(self, token: int) -> torch.Tensor:
        ids = torch.tensor([[token]], dtype=torch.long, device=self.device)
        positions = torch.tensor([[self.position]], device=self.device)
        self.position += 1
        return self._forward(ids, positions)

    def _forward(self, ids, positions) -> torch.Tensor:
        out = self.model(input_ids=ids, position_ids=positions, cache=self.cache,
                         use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].to(self.sample_device)
