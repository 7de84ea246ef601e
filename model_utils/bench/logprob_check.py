"""Is the fast path the same model? Comparisons of log-probabilities, not of greedy tokens.

In bf16 two correct implementations of one model part on greedy tokens within a few tokens of
random weights (near-ties that any other kernel order flips: BENCHMARKS.md). So, as vLLM's
tests do (check_logprobs_close), two greedy runs are compared step by step with each step's
top-k log-probabilities: while their tokens agree, go on; at the first token that differs, each
side's token must be among the other's top k, and the log-probability each side gives to both
tokens must agree within a stated tolerance; the comparison stops there, since from then on
the two continuations are different texts.

Second, a teacher-forced measure that does not depend on ties at all: the same token sequence
fed through both paths, and each next-token distribution compared with an fp32 run of the same
weights (KL divergence, top-1 agreement). The engine's error against fp32 may be at most
ERROR_RATIO_LIMIT times plain bf16's error against fp32 (the larger of plain's two ways of
computing the same tokens, see error_ratio): different kernels, no worse.
This module holds the comparisons and the fp32 reference; logprob_runs.py collects the runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

TOP_K = 5
# Alternatives recorded per step, more than the TOP_K the rule tests: where one side's token is
# outside the other's top 5, its rank and log-probability there say whether the miss is a
# near-tie just past the cut (a 248k vocabulary's dense top) or a different distribution.
RECORDED_K = 20
# Largest difference (nats) between the two sides' log-probabilities of the same token where
# their greedy tokens part, by compute dtype. fp32: both sides compute the same sums in
# another order (differences ~1e-6). 16-bit: a bf16 logit carries 8 bits of mantissa, so a
# logit of magnitude 10-30 is rounded by up to 0.03-0.06 before softmax, on each side and
# again inside every layer; 0.25 nats is a few of those roundings, far below what a wrong
# model gives (a perturbed side differs by whole nats, tests/model_utils/test_logprob_check).
TOLERANCE = {torch.float32: 1e-3, torch.float16: 0.25, torch.bfloat16: 0.25}
ERROR_RATIO_LIMIT = 1.1
# Sequences up to this long are teacher-forced in one forward; longer ones in chunks of
# ONE_PASS_CHUNK tokens through a cache (teacher_forced_plain).
ONE_PASS_TOKENS = 4096 + 512
ONE_PASS_CHUNK = 1024
# Below this mean KL (nats) the plain side is as exact as fp32 itself (an fp32 model against
# its own copy): the ratio is taken against this floor rather than a division by ~0.
KL_FLOOR = 1e-6


@dataclass
class Steps:
    """One greedy reply: its tokens, and for each the top-k (log-probability, id) pairs of the
    distribution it was chosen from."""

    tokens: list[int]
    top_logprobs: list[list[float]]
    top_ids: list[list[int]]


@dataclass
class Parting:
    """Where two greedy replies of one prompt first differ, and whether that is a near-tie."""

    index: int | None  # first differing token; None: equal over the compared length
    close: bool
    reason: str
    margin_a: float | None = None  # side A's top-1 minus top-2 log-probability there
    margin_b: float | None = None
    logprob_diff: float | None = None  # the larger of the two tokens' |lp_a - lp_b|
    # Each side's rank (0 = top-1) of the other side's token among its recorded alternatives;
    # None: not among them.
    rank_in_a: int | None = None
    rank_in_b: int | None = None
    # The fp32 copy's view of the same step (the two replies share every token before it):
    # its log-probability of each side's token, their ranks, and each side's error on them.
    reference: dict | None = None


def steps_from_topk(tokens: list[int], topk: list) -> Steps:
    """Steps from a token list and per-step torch.topk results (values, indices) of [V]."""
    values = [t.values.tolist() for t in topk[:len(tokens)]]
    ids = [t.indices.tolist() for t in topk[:len(tokens)]]
    return Steps(list(tokens), values, ids)


def steps_from_logits(tokens: list[int], logits: list[torch.Tensor],
                      k: int = RECORDED_K) -> Steps:
    """Steps from a token list and per-step raw logits [V] (plain generate's output_logits)."""
    topk = [torch.log_softmax(step.float(), -1).topk(k) for step in logits]
    return steps_from_topk(tokens, topk)


def compare_greedy(a: Steps, b: Steps, *, tolerance: float, top_k: int = TOP_K) -> Parting:
    """vLLM's check_logprobs_close for one prompt, with a tolerance on the logprobs: at the
    first differing token each side's token must be in the other's top `top_k`, and both sides'
    log-probabilities of both tokens within `tolerance`."""
    for i, (x, y) in enumerate(zip(a.tokens, b.tokens)):
        if x == y:
            continue
        ids_a, ids_b = a.top_ids[i], b.top_ids[i]
        lp_a, lp_b = dict(zip(ids_a, a.top_logprobs[i])), dict(zip(ids_b, b.top_logprobs[i]))
        margin_a = lp_a[ids_a[0]] - lp_a[ids_a[1]] if len(ids_a) > 1 else None
        margin_b = lp_b[ids_b[0]] - lp_b[ids_b[1]] if len(ids_b) > 1 else None
        found = Parting(i, False, "", margin_a, margin_b,
                        rank_in_a=ids_a.index(y) if y in ids_a else None,
                        rank_in_b=ids_b.index(x) if x in ids_b else None)
        if x in lp_b and y in lp_a:
            found.logprob_diff = max(abs(lp_a[x] - lp_b[x]), abs(lp_a[y] - lp_b[y]))
        within_top = (found.rank_in_b is not None and found.rank_in_b < top_k
                      and found.rank_in_a is not None and found.rank_in_a < top_k)
        if not within_top:
            found.reason = (f"token {i}: {x} (side A) is {_rank(found.rank_in_b, len(ids_b))} "
                            f"of side B, {y} (B) {_rank(found.rank_in_a, len(ids_a))} of A "
                            f"(both must be in the other's top {top_k})")
            return found
        found.close = found.logprob_diff <= tolerance
        found.reason = (f"token {i}: {x} vs {y}, log-probabilities differ by at most "
                        f"{found.logprob_diff:.4f} (tolerance {tolerance}); top-two margins "
                        f"{margin_a:.4f} (A) and {margin_b:.4f} (B)")
        return found
    if len(a.tokens) != len(b.tokens):
        n = min(len(a.tokens), len(b.tokens))
        return Parting(n, False, f"one reply ends at token {n}, the other goes on")
    return Parting(None, True, "equal tokens")


def _rank(rank: int | None, recorded: int) -> str:
    return f"rank {rank + 1}" if rank is not None else f"not in the top {recorded}"


def reference_at(parting: dict, a: Steps, b: Steps, reference: torch.Tensor) -> dict:
    """The fp32 reference's view of a parting: `reference` [positions, V] log-probabilities
    along side A's reply (equal to B's before the parting, so its row at the parting is the
    distribution both sides chose from)."""
    i = parting["index"]
    x, y = a.tokens[i], b.tokens[i]
    row = reference[i].float()
    order = row.argsort(descending=True)
    rank = {int(t): int((order == t).nonzero()) for t in (x, y)}
    lp_a, lp_b = dict(zip(a.top_ids[i], a.top_logprobs[i])), dict(zip(b.top_ids[i],
                                                                       b.top_logprobs[i]))
    out = {"lp_a_token": row[x].item(), "lp_b_token": row[y].item(),
           "rank_a_token": rank[x], "rank_b_token": rank[y], "top1": int(order[0]),
           "gap": row[x].item() - row[y].item()}
    # Each side's error against fp32 on the tokens it recorded (its own always).
    out["error_a"] = max(abs(lp_a[t] - row[t].item()) for t in (x, y) if t in lp_a)
    out["error_b"] = max(abs(lp_b[t] - row[t].item()) for t in (x, y) if t in lp_b)
    return out


def check_logprobs_close(a: list[Steps], b: list[Steps], *, tolerance: float) -> dict:
    """Every prompt's comparison and whether all are close."""
    partings = [compare_greedy(x, y, tolerance=tolerance) for x, y in zip(a, b)]
    return {"close": all(p.close for p in partings), "tolerance": tolerance,
            "first_mismatch": [p.index for p in partings],
            "partings": [asdict(p) for p in partings]}


def tolerance_for(dtype: torch.dtype) -> float:
    return TOLERANCE.get(dtype, TOLERANCE[torch.bfloat16])


# -- teacher-forced ------------------------------------------------------------------------------
def kl_stats(reference: torch.Tensor, other: torch.Tensor) -> dict:
    """KL(reference || other) per next-token distribution and top-1 agreement; both
    [rows, positions, V] log-probabilities (float32, on one device)."""
    kl = (reference.exp() * (reference - other)).sum(-1).clamp_min(0)  # [rows, positions]
    agree = (reference.argmax(-1) == other.argmax(-1)).float()
    return {"kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
            "top1_agreement": agree.mean().item()}


def error_ratio(engine: dict, plain: dict, plain_one_forward: dict | None = None) -> dict:
    """Engine against fp32 over plain against fp32 (mean KL), and whether it is within limit.

    `plain` is generate's way (prompt prefilled, then one token a step), `plain_one_forward` the
    same tokens in one whole-sequence forward. Both are the plain model, and in 16-bit they
    differ from each other by as much as the limit (CPU, demo model, bf16: 1.48e-4 against
    1.84e-4, BENCHMARKS.md): the engine is held to the larger of the two, and the ratio against
    each is reported."""
    paths = [plain] + ([plain_one_forward] if plain_one_forward else [])
    worst = max(p["kl_mean"] for p in paths)
    ratio = engine["kl_mean"] / max(worst, KL_FLOOR)
    out = {"engine_vs_fp32": engine, "plain_vs_fp32": plain, "ratio": ratio,
           "ratio_vs_generate": engine["kl_mean"] / max(plain["kl_mean"], KL_FLOOR),
           "within_limit": ratio <= ERROR_RATIO_LIMIT, "limit": ERROR_RATIO_LIMIT}
    if plain_one_forward:
        out["plain_one_forward_vs_fp32"] = plain_one_forward
        out["ratio_vs_one_forward"] = (engine["kl_mean"]
                                       / max(plain_one_forward["kl_mean"], KL_FLOOR))
    return out


@torch.inference_mode()
def teacher_forced_plain(model, sequences: list[list[int]], prompt_len: int, *,
                         incremental: bool = False) -> torch.Tensor:
    """[rows, positions, V] float32 log-probabilities of the plain model over the sequences:
    position t predicts token prompt_len + t (equal-length sequences).

    incremental=False: one forward over the whole sequences (the fp32 reference).
    incremental=True: what plain `generate` computes for the same tokens: the prompt prefilled
    into a DynamicCache, then one token a step. In 16-bit and 4-bit modes a one-token step takes
    other kernels than a whole-sequence matmul (bitsandbytes' 4-bit gemv, for one), so this is
    the peer the engine's decoding is held to."""
    from model_utils.runtime.decoders import input_device

    ids = torch.tensor(sequences, device=input_device(model))
    # Only the positions compared get logits (logits_to_keep): a 16k-token prompt's own would
    # be rows x 16k x vocabulary floats (10 GB a row at a 152k vocabulary).
    if not incremental and ids.shape[1] <= ONE_PASS_TOKENS:
        kept = ids.shape[1] - prompt_len + 1
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=kept).logits[:, :-1]
        return torch.log_softmax(logits.float(), -1)
    if not incremental:
        # Longer: the prompt in chunks into a cache, then the compared positions in one
        # forward. fp32 attention has no flash kernel: one pass over a 16k-token prompt would
        # hold its whole score matrix (7 rows x 28 heads x 16k x 16k floats, 197 GB).
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
        for start in range(0, prompt_len - 1, ONE_PASS_CHUNK):
            stop = min(start + ONE_PASS_CHUNK, prompt_len - 1)
            model(input_ids=ids[:, start:stop], cache=cache, use_cache=True,
                  logits_to_keep=1)
        logits = model(input_ids=ids[:, prompt_len - 1:-1], cache=cache,
                       use_cache=True).logits
        return torch.log_softmax(logits.float(), -1)
    out = model(input_ids=ids[:, :prompt_len], use_cache=True, logits_to_keep=1)
    steps, cache = [out.logits[:, -1].float()], out.past_key_values
    for t in range(prompt_len, ids.shape[1] - 1):
        out = model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
        steps.append(out.logits[:, -1].float())
        cache = out.past_key_values
    return torch.log_softmax(torch.stack(steps, 1), -1)


# -- an fp32 copy of the same weights ---------------------------------------------------------
def dequantized_weight(module) -> torch.Tensor | None:
    """The float weight of a quantized layer (bitsandbytes 4-bit or LLM.int8, the app's
    weight-only int4/int8), None for other modules."""
    from model_utils.layers.weight_only import WEIGHT_ONLY_LAYERS

    if isinstance(module, WEIGHT_ONLY_LAYERS):
        if not getattr(module, "readable", True):  # a layout only its kernel reads
            return _probed_weight(module)
        return module.dequantized(torch.float32)
    weight = getattr(module, "weight", None)
    kind = type(weight).__name__
    if kind == "Params4bit":
        if getattr(weight.quant_state, "packing_format_for_cpu", False):
            return _probed_weight(module)
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(weight.data, weight.quant_state).float()
    if kind == "Int8Params" and getattr(weight, "SCB", None) is not None:
        import bitsandbytes.functional as bnbf

        return bnbf.int8_vectorwise_dequant(weight.data, weight.SCB).float()
    return None


def _probed_weight(module) -> torch.Tensor:
    """The weight a layer computes with, read back through its own forward: the identity in,
    W^T (+ bias) out. For bitsandbytes' CPU kernel, which repacks a 4-bit weight at its first
    forward and keeps its block scales in bf16 from then on (bitsandbytes' inverse of that
    repacking is best-effort: measured, it gave another layer)."""
    dtype = getattr(module, "compute_dtype", None) or torch.bfloat16
    device = next(module.buffers(), None)
    device = module.weight.device if device is None else device.device
    eye = torch.eye(module.in_features, dtype=dtype, device=device)
    with torch.inference_mode():
        out = module(eye).float()
    if module.bias is not None:
        out -= module.bias.float()
    return out.T.contiguous()


@torch.inference_mode()
def fp32_copy(model):
    """The model with the weights it computes with, in fp32: a bf16 weight upcast exactly, a
    quantized one dequantized (so the reference has the same weights, only exact arithmetic;
    an int4 weight in fp32 where its kernel rounds each dequantized weight to bf16).
    Built from the config on the model's device (unfused, plain sdpa attention)."""
    import copy

    from transformers import AutoModelForCausalLM

    from model_utils.runtime.decoders import input_device

    config = copy.deepcopy(model.config)
    for name in ("quantization_config",):
        if hasattr(config, name):
            delattr(config, name)
    config._attn_implementation = "sdpa"
    with torch.device(input_device(model)):
        reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                     attn_implementation="sdpa")
    reference.eval()
    params = dict(reference.named_parameters())
    owned = set()
    for name, module in model.named_modules():
        weight = dequantized_weight(module) if f"{name}.weight" in params else None
        if weight is not None:  # (a fused layer has no counterpart: its parent is below)
            params[f"{name}.weight"].copy_(weight.reshape(params[f"{name}.weight"].shape))
            owned.add(f"{name}.weight")
        for fused_name, parts in getattr(module, "fused_linears", {}).items():  # linear_fusion
            fused = getattr(module, fused_name)
            sizes = [size for _, size in parts]
            whole = dequantized_weight(fused)  # quantized after the fusing
            whole = fused.weight if whole is None else whole
            for (part, _), piece in zip(parts, whole.split(sizes)):
                params[f"{name}.{part}.weight"].copy_(piece.float())
            owned.add(f"{name}.{fused_name}.weight")
            if fused.bias is not None:
                for (part, _), piece in zip(parts, fused.bias.split(sizes)):
                    params[f"{name}.{part}.bias"].copy_(piece.float())
                owned.add(f"{name}.{fused_name}.bias")
    for name, param in model.named_parameters():
        if name not in owned and name in params:
            params[name].copy_(param.float())
    if getattr(config, "tie_word_embeddings", False):
        reference.tie_weights()
    return reference
