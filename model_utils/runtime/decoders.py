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
    """A dynamic cache that grows each step (what plain model.generate uses)."""

    name = "eager"

    def __init__(self, model, step_fn=None):
        self.model = model
        self.step_fn = step_fn or model  # what runs the 1-token steps (compiled or not)
        self.device = input_device(model)
        self.sample_device = self.device
        self.cache = None
        self.position = 0

    def _new_cache(self, tokens: int):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def prefill(self, input_ids: list[int], *, max_new_tokens: int) -> torch.Tensor:
        # The prompt always runs eagerly: its length varies from reply to reply.
        self.cache = self._new_cache(len(input_ids) + max_new_tokens)
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
        out = self.step_fn(input_ids=ids, position_ids=positions, cache=self.cache,
                           use_cache=True, logits_to_keep=1)
        # A CUDA graph's output buffer is overwritten by its next replay: copy what we keep.
        return out.logits[0, -1].to(self.sample_device, copy=True)


# Cache lengths are rounded up to one of these, so a new prompt length or max_new_tokens reuses
# an already compiled step instead of recompiling (each compiled shape costs seconds).
CACHE_BUCKETS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def cache_bucket(tokens: int) -> int:
    for bucket in CACHE_BUCKETS:
        if tokens <= bucket:
            return bucket
    raise ValueError(f"{tokens} tokens exceed the largest cache bucket ({CACHE_BUCKETS[-1]})")


class StaticCaches:
    """Preallocated KV caches, one per bucket length, reused across replies."""

    def __init__(self, model):
        self.model = model
        self._caches: dict[int, object] = {}

    def get(self, bucket: int):
        from transformers import StaticCache

        cache = self._caches.get(bucket)
        if cache is None:
            cache = StaticCache(config=self.model.config, max_cache_len=bucket)
            self._caches[bucket] = cache
        else:
            cache.reset()
        return cache


class StaticDecoder(EagerDecoder):
    """Prefill eagerly, then decode one token at a time with fixed shapes into a preallocated
    cache of a bucketed length, so that `step_fn` can be a captured CUDA graph; it is shared by
    all replies of a loaded model (see fast_path.FastPath)."""

    def __init__(self, model, caches: StaticCaches, step_fn=None, name: str = "static-cache"):
        super().__init__(model, step_fn)
        self.caches = caches
        self.name = name

    def _new_cache(self, tokens: int):
        return self.caches.get(cache_bucket(tokens))
