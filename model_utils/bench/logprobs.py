"""The benchmark's correctness columns: logprobs_close and logit_error_ratio per batch.

For each batch size b the engine decodes b greedy requests together (one alone for b = 1, each
of the compared prompts in turn) recording their top-k log-probabilities, and runs the same
sequences (prompt + its greedy reply) teacher-forced through its path; plain generate does the
same on the same prompts (b at once, unpadded), the plain model is teacher-forced the way
generate computes (prompt prefilled, then one token a step), and an fp32 copy of the same weights
gives the reference distributions (logprob_check.py). The engine's part is collected first and kept on
the CPU, so the command-line benchmark can unload the engine before it loads the peer.
"""

from __future__ import annotations

import logging

import torch

from model_utils.runtime.decoders import input_device

from . import logprob_check as check
from .logprob_runs import engine_greedy, engine_teacher_forced, plain_greedy
from .measure import PeerRunner, run_here

log = logging.getLogger(__name__)


def groups(batches: list[int], match_prompts: int) -> dict[int, list[list[int]]]:
    """Per batch size: the prompt indices decoded together (batch 1: each prompt alone)."""
    return {b: [[i] for i in range(match_prompts)] if b == 1 else [list(range(b))]
            for b in batches}


def engine_side(engine, prompts: list[list[int]], batches: list[int], new_tokens: int,
                match_prompts: int, run_worker: PeerRunner = run_here,
                at_once: int | None = None) -> dict:
    """{b: [(indices, steps, teacher-forced log-probabilities on the CPU)]}; `at_once`: the
    most replies submitted together."""
    prompt_len = len(prompts[0])
    found = {}
    for b, index_groups in groups(batches, match_prompts).items():
        found[b] = []
        for indices in index_groups:
            group = [prompts[i] for i in indices]
            steps = engine_greedy(engine, group, new_tokens, at_once)
            sequences = [p + s.tokens for p, s in zip(group, steps)]
            forced = run_worker(lambda y, s=sequences: engine_teacher_forced(
                engine, s, prompt_len, should_yield=y))
            found[b].append((indices, steps, sequences, forced))
    return found


def fp32_reference(model, *, headroom: float = 1.2):
    """fp32_copy(model), or None with the reason when the device lacks the memory for it."""
    device = input_device(model)
    params = sum(p.numel() * (2 if type(p).__name__ == "Params4bit" else 1)
                 for p in model.parameters())
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if params * 4 * headroom > free:
            return None, (f"an fp32 copy ({params * 4 / 2**30:.1f} GB) does not fit the "
                          f"{free / 2**30:.1f} GB free")
    return check.fp32_copy(model), ""


def compare(model, found: dict, run_peer: PeerRunner = run_here) -> dict[int, dict]:
    """Plain model's side of every group, compared with the engine's: {b: result}."""
    tolerance = check.tolerance_for(model.dtype)
    reference, why_not = fp32_reference(model)
    results = {}
    for b, entries in found.items():
        engine_steps, plain_steps, kls, at_partings = [], [], [], []
        for indices, steps, sequences, forced in entries:
            prompts = [s[:len(s) - len(x.tokens)] for s, x in zip(sequences, steps)]
            new_tokens = len(steps[0].tokens)
            plain = run_peer(lambda y, p=prompts, n=new_tokens: plain_greedy(model, p, n, y))
            engine_steps += steps
            plain_steps += plain
            if reference is not None:
                prompt_len = len(prompts[0])
                ref = run_peer(lambda y, r=reference, s=sequences, n=prompt_len:
                               check.teacher_forced_plain(r, s, n))
                theirs = run_peer(lambda y, s=sequences, n=prompt_len:
                                  check.teacher_forced_plain(model, s, n, incremental=True))
                one_pass = run_peer(lambda y, s=sequences, n=prompt_len:
                                    check.teacher_forced_plain(model, s, n))
                at_partings += _reference_at_partings(steps, plain, ref, tolerance)
                mine = forced.to(ref.device)
                kls.append((check.kl_stats(ref, mine), check.kl_stats(ref, theirs),
                            check.kl_stats(ref, one_pass)))
                del ref, mine, theirs, one_pass
        result = check.check_logprobs_close(engine_steps, plain_steps, tolerance=tolerance)
        for parting, seen in zip(result["partings"], at_partings):
            parting["reference"] = seen
        if kls:
            result["teacher_forced"] = check.error_ratio(
                _mean(k[0] for k in kls), _mean(k[1] for k in kls), _mean(k[2] for k in kls))
        else:
            result["teacher_forced"] = {"skipped": why_not}
        results[b] = result
    del reference
    return results


def _reference_at_partings(steps, plain, reference, tolerance: float) -> list[dict | None]:
    """Per row, the fp32 reference's view of where the engine's and plain's replies part."""
    seen = []
    for row, (mine, theirs) in enumerate(zip(steps, plain)):
        parting = check.compare_greedy(mine, theirs, tolerance=tolerance)
        if parting.index is None or parting.index >= min(len(mine.tokens), len(theirs.tokens)):
            seen.append(None)
        else:
            seen.append(check.reference_at({"index": parting.index}, mine, theirs,
                                           reference[row]))
    return seen


def _mean(stats) -> dict:
    stats = list(stats)
    return {"kl_mean": sum(s["kl_mean"] for s in stats) / len(stats),
            "kl_max": max(s["kl_max"] for s in stats),
            "top1_agreement": sum(s["top1_agreement"] for s in stats) / len(stats)}


def row_fields(result: dict | None) -> dict:
    """BenchRow's logprobs_close, logit_error_ratio and logprobs from one batch's result."""
    if not result:
        return {"logprobs_close": None, "logit_error_ratio": None, "logprobs": {}}
    forced = result.get("teacher_forced", {})
    ratio = forced.get("ratio")
    return {"logprobs_close": result["close"],
            "logit_error_ratio": round(ratio, 3) if ratio is not None else None,
            "logprobs": result}
