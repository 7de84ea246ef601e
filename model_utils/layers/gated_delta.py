"""Qwen3.5's linear-attention layer (Gated DeltaNet) made cheap to decode.

Three changes to transformers' forward of the layer, each compared with the original in the tests:

- Its four input projections (q/k/v for the convolution, the output gate z, the delta rule's
  beta and its decay's input a) read the same hidden state: one matmul (linear_fusion.py). Two
  of them have only 32 outputs, a kernel of fixed latency each.
- Decoding one token of rows that keep their states in the engine's slots (a cache that says
  `updates_in_place`, runtime/linear_states.py), the short convolution and the delta rule run
  as fla's Triton kernels writing both states where they are read. transformers' path returns
  a new recurrent state that the cache then copies into its slot, a copy of the whole state per
  layer and step that cost most of what the kernel itself did (BENCHMARKS.md). The decay and
  beta's sigmoid are computed inside the kernel too, as fla offers, instead of as separate
  elementwise kernels. Every other call (prefill, a cache that keeps its own tensors, the CPU)
  runs transformers' own code.
- A prompt whose linear states the engine keeps at a point inside it (state_snapshots.py, for
  the conversation's next turn) runs the delta rule in two parts within the one forward and
  keeps the states between them, where otherwise the prompt's forward stops at that point and
  a second forward of every layer takes its last 16-31 tokens (BENCHMARKS.md).

The kernel call is a torch custom op, so that torch.compile treats it as one opaque step that
mutates the two states (and CUDA graphs replay it like any kernel).
"""

from __future__ import annotations

import logging
import sys
import types

import torch
from torch import nn

from .linear_fusion import fuse_linears, plain_linears

log = logging.getLogger(__name__)

# Gated DeltaNet classes whose forward fused_forward reproduces (transformers 5.24; Qwen3-Next's
# lays its projections out interleaved per head, and keeps its own forward).
FUSABLE = {"Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"}
PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def fuse_gated_delta(model: nn.Module) -> int:
    """Give every fusable linear-attention layer of `model` the forward below; returns how many."""
    fused = 0
    kernels = None
    for module in model.modules():
        if type(module).__name__ not in FUSABLE:
            continue
        if plain_linears(module, PROJECTIONS):
            module.in_proj_sizes = fuse_linears(module, PROJECTIONS, "in_proj")
            module.home = sys.modules[type(module).__module__]  # the model's modeling file
            module.forward = types.MethodType(fused_forward, module)
            fused += 1
        if hasattr(module, "in_proj"):  # fused now, or before its weights were quantized
            if kernels is None:  # asked here, not in the forward that torch.compile traces
                kernels = module.A_log.is_cuda and kernels_available()
            module.decodes_in_place = kernels
    if fused:
        log.info("fused the input projections of %d linear-attention layers; decoding %s", fused,
                 "with fla's kernels, states in place" if kernels else "through transformers")
    return fused


def kernels_available() -> bool:
    """fla's Triton kernels import (a CUDA machine with fla-core installed)."""
    try:
        import fla.modules.causal_conv1d.ops  # noqa: F401
        import fla.ops.gated_delta_rule.fused_recurrent  # noqa: F401
    except Exception:  # noqa: BLE001 - ImportError, or Triton finding no GPU
        return False
    return True


def fused_forward(self: nn.Module, hidden_states: torch.Tensor, cache=None,
                  attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """transformers' Gated DeltaNet forward with one input matmul, and the in-place decode step
    where it applies."""
    home = self.home
    hidden_states = home.apply_mask_to_padding_states(hidden_states, attention_mask)
    batch_size, seq_len, _ = hidden_states.shape
    mixed_qkv, z, b, a = self.in_proj(hidden_states).split(self.in_proj_sizes, dim=-1)
    z = z.reshape(batch_size, seq_len, -1, self.head_v_dim)
    if self.decodes_in_place and seq_len == 1 and getattr(cache, "updates_in_place", False):
        conv_state = cache.get_conv_state(self.layer_idx)
        recurrent_state = cache.get_recurrent_state(self.layer_idx)
        if conv_state is not None and recurrent_state is not None:
            core = torch.ops.qwen_chat.gated_delta_decode(
                mixed_qkv, a, b, conv_state, self.conv1d.weight.squeeze(1), self.conv1d.bias,
                self.A_log, self.dt_bias, recurrent_state, self.num_k_heads, self.head_k_dim)
            return _output(self, core, z, batch_size, seq_len)
    core = _transformers_core(self, mixed_qkv, a, b, cache, batch_size, seq_len, **kwargs)
    return _output(self, core, z, batch_size, seq_len)


def _output(self, core: torch.Tensor, z: torch.Tensor, batch_size: int,
            seq_len: int) -> torch.Tensor:
    core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(core.reshape(batch_size, seq_len, -1))


def _transformers_core(self, mixed_qkv, a, b, cache, batch_size, seq_len, **kwargs):
    """The convolution and the delta rule as transformers 5.24's forward computes them; with a
    cache that asks for the states after its first `keep_at` tokens (linear_states.StateView),
    the delta rule runs in two parts and the states between them are kept."""
    home = self.home
    if cache is not None:
        conv_state = cache.get_conv_state(self.layer_idx, state_idx=0)
        recurrent_state = cache.get_recurrent_state(self.layer_idx, state_idx=0)
    else:
        conv_state, recurrent_state = None, None
    keep_at = getattr(cache, "keep_at", 0) if seq_len > 1 else 0
    mixed_qkv = mixed_qkv.transpose(1, 2)
    kept_conv = None
    if conv_state is not None and seq_len == 1 and not cache.is_recording_past(self.layer_idx):
        mixed_qkv = home.causal_conv1d_update(mixed_qkv, conv_state,
                                              self.conv1d.weight.squeeze(1), self.conv1d.bias,
                                              self.activation)
    else:
        if cache is not None:
            mixed_qkv = cache.update_conv_state(mixed_qkv, self.layer_idx,
                                                conv_kernel_size=self.conv_kernel_size)
        if keep_at:  # the convolution's inputs up to that token: its state there
            window = mixed_qkv[..., :mixed_qkv.shape[-1] - seq_len + keep_at]
            kernel = self.conv_kernel_size
            kept_conv = nn.functional.pad(window, (max(0, kernel - window.shape[-1]), 0))
            kept_conv = kept_conv[..., -kernel:]
        mixed_qkv = home.causal_conv1d_fn(mixed_qkv, self.conv1d.weight.squeeze(1),
                                          self.conv1d.bias, activation=self.activation, **kwargs)
        if cache is not None:
            mixed_qkv = mixed_qkv[:, :, -seq_len:]
    mixed_qkv = mixed_qkv.transpose(1, 2)
    query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim],
                                    dim=-1)
    query = query.reshape(batch_size, seq_len, -1, self.head_k_dim)
    key = key.reshape(batch_size, seq_len, -1, self.head_k_dim)
    value = value.reshape(batch_size, seq_len, -1, self.head_v_dim)
    beta = b.sigmoid()
    g = -self.A_log.float().exp() * nn.functional.softplus(a.float() + self.dt_bias)
    cu_seqlens = kwargs.pop("cu_seq_lens_q", None)
    if recurrent_state is not None and seq_len == 1:
        rule = home.torch_recurrent_gated_delta_rule
    else:
        rule = home.torch_chunk_gated_delta_rule

    def run(part: slice, initial):
        return rule(query[:, part], key[:, part], value[:, part], g=g[:, part],
                    beta=beta[:, part], initial_state=initial,
                    output_final_state=cache is not None, use_qk_l2norm_in_kernel=True,
                    cu_seqlens=cu_seqlens, **kwargs)

    if kept_conv is not None:
        first, kept_state = run(slice(0, keep_at), recurrent_state)
        cache.keep(self.layer_idx, kept_conv, kept_state)
        rest, last_state = run(slice(keep_at, seq_len), kept_state)
        core = torch.cat([first, rest], dim=1)
    else:
        core, last_state = run(slice(None), recurrent_state)
    if cache is not None:
        cache.update_recurrent_state(last_state, self.layer_idx)
    return core


@torch.library.custom_op("qwen_chat::gated_delta_decode",
                         mutates_args=("conv_state", "recurrent_state"))
def gated_delta_decode(mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       conv_state: torch.Tensor, conv_weight: torch.Tensor,
                       conv_bias: torch.Tensor | None, A_log: torch.Tensor,
                       dt_bias: torch.Tensor, recurrent_state: torch.Tensor, key_heads: int,
                       key_dim: int) -> torch.Tensor:
    """One token of every row: the causal convolution over [rows, 1, conv channels] and the
    gated delta rule, both states updated in place; returns [rows, 1, value heads, value dim]."""
    import triton
    from fla.modules.causal_conv1d.ops import causal_conv1d_update
    from fla.ops.gated_delta_rule.fused_recurrent import (
        fused_recurrent_gated_delta_rule_fwd_kernel as recurrent_kernel,
    )

    rows = mixed_qkv.shape[0]
    mixed, _ = causal_conv1d_update(mixed_qkv, conv_state, weight=conv_weight, bias=conv_bias,
                                    activation="silu")
    value_heads, value_dim = recurrent_state.shape[1], recurrent_state.shape[3]
    width = key_heads * key_dim
    query, key, value = (t.contiguous() for t in
                         mixed.view(rows, -1).split([width, width, value_heads * value_dim], -1))
    out = torch.empty(rows, 1, value_heads, value_dim, dtype=mixed.dtype, device=mixed.device)
    block_v = min(8, triton.next_power_of_2(value_dim))  # fla's own choices for this kernel
    grid = (triton.cdiv(value_dim, block_v) * rows * value_heads,)
    recurrent_kernel[grid](
        q=query, k=key, v=value, g=a.contiguous(), gk=None, gv=None, beta=b.contiguous(),
        A_log=A_log, dt_bias=dt_bias, o=out, h0=recurrent_state, ht=recurrent_state,
        cu_seqlens=None, scale=key_dim ** -0.5, T=1, H=key_heads, HV=value_heads, K=key_dim,
        V=value_dim, BK=triton.next_power_of_2(key_dim), BV=block_v, IS_BETA_HEADWISE=True,
        USE_QK_L2NORM_IN_KERNEL=True, APPLY_BETA_SIGMOID=True, ALLOW_NEG_EIGVAL=False,
        STATE_V_FIRST=False, num_warps=1, num_stages=3)
    return out


@gated_delta_decode.register_fake
def _(mixed_qkv, a, b, conv_state, conv_weight, conv_bias, A_log, dt_bias, recurrent_state,
      key_heads, key_dim):
    return mixed_qkv.new_empty(mixed_qkv.shape[0], 1, recurrent_state.shape[1],
                               recurrent_state.shape[3])
