"""Model layers the app swaps into a loaded model: weight-only int4/int8 linear layers
(weight_only) and one q/k/v matmul per attention layer (fused_qkv). Below loading and runtime:
they import neither."""
