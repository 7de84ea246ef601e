"""Several linear projections of one input as one matmul.

Decoding one token, each projection is a matrix-vector product: a small one (a key projection,
a gate of 32 outputs) costs a kernel of fixed latency plus cuBLAS's split-K reduction, far from
the GPU's memory bandwidth. Their weights stacked into one [sum of outputs, in] matrix make one
product, split afterwards. The fused modules (fused_qkv, fused_mlp, gated_delta) use this to
give a known module a forward that is transformers' own with the projections replaced by one.

The weights are moved, not copied (memory stays the same); each fused layer is recorded on its
module as `fused_linears[fused name] = ((original name, out features), ...)`, which is how the
log-probability checks rebuild the unfused model (model_utils/bench/logprob_check.py).
"""

from __future__ import annotations

import torch
from torch import nn


def plain_linears(module: nn.Module, names: tuple[str, ...]) -> bool:
    """The named children are plain nn.Linear on one device and dtype (not bitsandbytes or peft
    layers, which subclass or wrap nn.Linear, nor layers whose weights accelerate offloads), all
    with or all without bias, over the same input size."""
    layers = [getattr(module, name, None) for name in names]
    if not all(type(layer) is nn.Linear for layer in layers):
        return False
    weights = [layer.weight for layer in layers]
    if any(w.device.type == "meta" for w in weights) or \
            len({(w.device, w.dtype) for w in weights}) > 1:
        return False
    return len({layer.bias is None for layer in layers}) == 1 and \
        len({layer.in_features for layer in layers}) == 1


def fuse_linears(module: nn.Module, names: tuple[str, ...], fused_name: str) -> tuple[int, ...]:
    """Replace `module`'s children `names` by one nn.Linear `fused_name` whose output is theirs
    concatenated in that order; returns their output sizes (for the split)."""
    layers = [getattr(module, name) for name in names]
    sizes = tuple(layer.out_features for layer in layers)
    with torch.no_grad():
        fused = nn.Linear(layers[0].in_features, sum(sizes), bias=layers[0].bias is not None,
                          device="meta")
        fused.weight = nn.Parameter(torch.cat([layer.weight for layer in layers]),
                                    requires_grad=False)
        if layers[0].bias is not None:
            fused.bias = nn.Parameter(torch.cat([layer.bias for layer in layers]),
                                      requires_grad=False)
    for name in names:
        delattr(module, name)  # their weights are freed
    setattr(module, fused_name, fused)
    record = dict(getattr(module, "fused_linears", {}))
    record[fused_name] = tuple(zip(names, sizes))
    module.fused_linears = record
    return sizes
