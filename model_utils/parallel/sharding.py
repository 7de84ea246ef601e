"""Megatron-style sharding of a loaded decoder over a torch.distributed group, in place.

Each rank keeps 1/N of the attention heads (q/k/v rows, o_proj columns) and 1/N of the MLP's
intermediate columns (gate/up rows, down columns). The column-parallel layers need no
communication; the row-parallel ones (o_proj, down_proj) produce partial sums that one
all_reduce per layer output adds up, so every rank holds the same hidden states afterwards.
Embeddings, norms and lm_head stay whole on every rank (so the logits, and the token every rank
samples from them, are the same everywhere).

transformers 5.24's own `tp_plan="auto"` was tried first: with a gloo group on the CPU it loads
the model unsharded (q_proj stays [128, 128] on both ranks of the demo model), so it does not
serve here; this module does the split itself. It relies on what the Llama-family attention
(Qwen2/Qwen3, Llama, Mistral) does in transformers 5.x: the head count is read back from the
projection's output with `view(..., -1, head_dim)`, and the GQA ratio stays the same when q and
kv heads are split alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..errors import LoadError

COLUMN_PARALLEL = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                   "mlp.gate_proj", "mlp.up_proj")
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


def check_divisible(config, world_size: int) -> None:
    """Refuse a shape the split cannot cut evenly, in words the user can act on."""
    text = getattr(config, "text_config", config)
    sizes = {"attention heads": getattr(text, "num_attention_heads", None),
             "key/value heads": getattr(text, "num_key_value_heads", None)
             or getattr(text, "num_attention_heads", None),
             "MLP columns": getattr(text, "intermediate_size", None)}
    for what, size in sizes.items():
        if not isinstance(size, int):
            raise LoadError(f"--tp {world_size}: this model's config has no {what} count; "
                            "tensor parallelism supports Llama/Qwen-style decoders")
        if size % world_size:
            raise LoadError(f"--tp {world_size}: the model's {size} {what} do not split "
                            f"evenly over {world_size} workers")


def _split_linear(linear: nn.Linear, dim: int, rank: int, world_size: int) -> None:
    """Keep this rank's slice of the weight along `dim` (0: output rows, 1: input columns)."""
    weight = linear.weight.data
    part = weight.shape[dim] // world_size
    linear.weight = nn.Parameter(weight.narrow(dim, rank * part, part).contiguous(),
                                 requires_grad=False)
    if dim == 0:
        linear.out_features = part
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias.data.narrow(0, rank * part, part)
                                       .contiguous(), requires_grad=False)
    else:
        linear.in_features = part
        if linear.bias is not None and rank != 0:
            # The bias is added once, after the sum: only rank 0 keeps it.
            linear.bias = nn.Parameter(torch.zeros_like(linear.bias), requires_grad=False)


def _all_reduce_output(_module, _inputs, output):
    # Runs inside the forward, so a GPU build could capture it in a CUDA graph (untested: NCCL
    # all_reduce under graph capture needs the group's stream setup; CPU/gloo is what is tested).
    dist.all_reduce(output)
    return output


def _submodule(layer: nn.Module, dotted: str) -> nn.Linear:
    module = layer
    for name in dotted.split("."):
        module = getattr(module, name, None)
        if module is None:
            break
    if not isinstance(module, nn.Linear):
        raise LoadError(f"tensor parallelism supports Llama/Qwen-style decoders with plain "
                        f"Linear layers; this model has no Linear {dotted!r} (a quantized "
                        "mode, or another architecture)")
    return module


def decoder_layers(model: nn.Module):
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None) if inner is not None else None
    if layers is None:
        raise LoadError("tensor parallelism supports Llama/Qwen-style decoders "
                        "(model.model.layers); this model has another layout")
    return layers


def shard_model(model: nn.Module, rank: int, world_size: int) -> None:
    """Split every decoder layer of `model` for this rank, in place (frees the other slices)."""
    check_divisible(model.config, world_size)
    for layer in decoder_layers(model):
        for name in COLUMN_PARALLEL:
            _split_linear(_submodule(layer, name), 0, rank, world_size)
        for name in ROW_PARALLEL:
            linear = _submodule(layer, name)
            _split_linear(linear, 1, rank, world_size)
            linear.register_forward_hook(_all_reduce_output)
