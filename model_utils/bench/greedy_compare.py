"""Greedy output of the engine's path against plain generate's on a model with peaked
distributions (peaked_model.py), prompt by prompt, with where and why they part.

    python -m model_utils.bench.greedy_compare --model /tmp/peaked --mode bf16 --prompts 3 \\
        --new-tokens 128 --out greedy.json

Prompts are cut from the text the model was trained on, so its next tokens are clear choices.
For each prompt: whether the tokens are equal; if not, the token where they part, each side's
margin between its top two log-probabilities there (a small margin: a near-tie that rounding
flipped) and the logprob check's verdict; and the teacher-forced error ratio against fp32.
Writes JSON and a markdown summary next to it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from model_utils.engine import Engine
from model_utils.loading.loaded_model import LoadRequest
from model_utils.loading.placement import Placement

from . import logprobs as bench_logprobs
from .peaked_model import sample_prompts
from .per_mode import load_peer


def compare(model: str, mode: str, *, prompts: int = 3, prompt_tokens: int = 64,
            new_tokens: int = 128, placement: str | None = None, compile: bool = True) -> dict:
    folder = Path(model)
    engine = Engine(max_batch=max(prompts, 1), compile=compile)
    engine.registry.allow_root(str(folder))
    placement = placement or ("cuda:0" if torch.cuda.is_available() else "cpu")
    status = engine.load(LoadRequest(str(folder), mode, Placement(placement),
                                     context_tokens=max(1024, prompt_tokens + new_tokens + 64)))
    chosen = sample_prompts(folder, prompts, prompt_tokens)
    found = bench_logprobs.engine_side(engine, chosen, [1], new_tokens, prompts)
    engine.unload()
    peer = load_peer(folder, mode)
    result = bench_logprobs.compare(peer, found)[1]
    engine_tokens = [steps.tokens for _, group, _, _ in found[1] for steps in group]
    del peer
    return {"model": str(folder), "mode": mode, "decode_path": status["decode_path"],
            "prompts": prompts, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "greedy_equal": all(i is None for i in result["first_mismatch"]),
            "first_mismatch": result["first_mismatch"], "logprobs_close": result["close"],
            "tolerance": result["tolerance"], "partings": result["partings"],
            "teacher_forced": result.get("teacher_forced"),
            "engine_tokens": engine_tokens}


def markdown(report: dict) -> str:
    lines = [(f"Greedy, {report['mode']}, {report['decode_path']}: {report['prompts']} "
              f"prompts x {report['new_tokens']} tokens; equal: **{report['greedy_equal']}**, "
              f"logprobs close: **{report['logprobs_close']}** (tolerance "
              f"{report['tolerance']} nats)"), "",
             "| prompt | first differing token | margin engine | margin plain | verdict |",
             "|---|---|---|---|---|"]
    for i, p in enumerate(report["partings"]):
        def fmt(x):
            return "-" if x is None else f"{x:.4f}"
        lines.append(f"| {i} | {'-' if p['index'] is None else p['index']} | "
                     f"{fmt(p['margin_a'])} | {fmt(p['margin_b'])} | {p['reason']} |")
    forced = report.get("teacher_forced") or {}
    if "ratio" in forced:
        lines += ["", (f"Teacher-forced, mean KL against fp32: engine "
                       f"{forced['engine_vs_fp32']['kl_mean']:.3g}, plain "
                       f"{forced['plain_vs_fp32']['kl_mean']:.3g}; ratio {forced['ratio']:.3f} "
                       f"(limit {forced['limit']}); top-1 agreement with fp32 "
                       f"{forced['engine_vs_fp32']['top1_agreement']:.3f} / "
                       f"{forced['plain_vs_fp32']['top1_agreement']:.3f}")]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model_utils.bench.greedy_compare",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a model folder (peaked_model --out)")
    parser.add_argument("--mode", default="bf16")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--placement", help="default: cuda:0 with a GPU, else cpu")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--out", default="greedy.json")
    args = parser.parse_args(argv)
    try:
        report = compare(args.model, args.mode, prompts=args.prompts,
                         prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                         placement=args.placement, compile=not args.no_compile)
    except (ValueError, RuntimeError) as error:
        print(f"greedy_compare: {error}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.write_text(json.dumps(report, indent=2))
    text = markdown(report)
    out.with_suffix(".md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
