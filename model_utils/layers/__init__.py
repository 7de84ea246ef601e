"""Model layers the app swaps into a loaded model: weight-only int4/int8 linear layers
(weight_only) and projections fused into one matmul for decoding (decode_fusions: q/k/v,
gate/up, Qwen3.5's linear-attention inputs and its in-place decode step). Below loading and
runtime: they import neither."""
