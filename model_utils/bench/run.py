"""Benchmark: the engine's decode path against plain from_pretrained + model.generate.

    python -m model_utils.bench --model demo --modes bf16,nf4 --batch 1,8 \\
        --prompt-tokens 128 --new-tokens 256 --out results.json

For each mode it loads the model through the engine (the path a user's load takes), measures
time to first token and decode speed for one stream and for `batch` concurrent requests (decoded
together by the engine's batch scheduler, each submitted from its own thread the way concurrent
chats arrive), unloads it, then loads the same checkpoint the way most tutorials do and times
model.generate on the same prompts in the same process. Every path is run once untimed before
it is timed. Correctness, per mode and batch: `logprobs_close` (greedy replies compared by
their top-k log-probabilities where they part) and `logit_error_ratio` (teacher-forced KL
against an fp32 copy of the same weights, engine over plain; see logprob_check.py);
`greedy_match` (equal tokens) in fp32 only. --random-from-config builds a model of a published
shape with random weights (speed does not depend on the values), so real sizes can be measured
without downloading anything.

The pieces (model_utils/bench/): inputs (prompts, random checkpoints), measure (timing), logprobs
(the correctness columns), per_mode (one mode; the loaded model for the UI), gate (replies
before the benchmark), report (table, summary, chart).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

import torch

from model_utils.engine import Engine
from model_utils.engine_config import EngineConfig, add_model_args
from model_utils.engine_factory import build_engine
from model_utils.loading.modes import get_mode
from model_utils.loading.placement import Placement

from . import quality
from .inputs import build_random_model, random_prompts
from .per_mode import LOADED_LIMITS, bench_loaded, bench_mode
from .report import (
    BenchRow,
    chart_figure,
    details_table,
    markdown_table,
    save_chart,
    speed_note,
    summary_table,
)

__all__ = ["LOADED_LIMITS", "BenchRow", "bench_loaded", "bench_mode", "build_random_model",
           "chart_figure", "details_table", "main", "markdown_table", "random_prompts",
           "speed_note", "summary_table"]


def run(args: argparse.Namespace) -> list[BenchRow]:
    batches = [int(b) for b in args.batch.split(",")]
    if args.int4_group:
        use_int4_group(args.int4_group)
    engine = build_engine(EngineConfig.from_args(args, max_batch=args.max_batch or max(batches)))
    model_name = args.model
    if args.random_from_config:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        folder = Path(tempfile.mkdtemp(prefix="bench-model-"))
        build_random_model(Path(args.random_from_config), folder, device)
        model_name = str(folder)
    if model_name != "demo":
        engine.registry.allow_root(model_name)
    placement = Placement(args.placement or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    modes = [m.strip() for m in args.modes.split(",")]
    reference = quality_reference(engine, model_name, args.quality_positions)
    warm = args.process_warm_up if args.process_warm_up is not None \
        else not torch.cuda.is_available()
    if warm:
        # One untimed pass of the first mode, short: on the CPU the first mode measured in a
        # process read far below the same mode measured again later in that process
        # (fp32: 0.03-0.46x of plain generate first, 0.95-0.98x third), even with each
        # path warmed up inside the mode. On a GPU this would compile everything twice.
        bench_mode(engine, model_name, modes[0], placement, batches, args.prompt_tokens,
                   min(args.new_tokens, 16), 1, logprobs=False)
    rows = []
    for mode in modes:
        rows += bench_mode(engine, model_name, mode, placement, batches,
                           args.prompt_tokens, args.new_tokens, args.match_prompts,
                           logprobs=not args.no_logprobs, reference=reference)
        print(markdown_table(rows[-len(batches):]), flush=True)
    return rows


def use_int4_group(group: int) -> None:
    """int4-wo in groups of `group` weights, in this process only: what another group size
    would cost in speed and quality, measured before the mode's default changes."""
    from model_utils.loading import modes

    mode = modes.MODES["int4-wo"]
    modes.MODES["int4-wo"] = replace(
        mode, label=mode.label.replace(f"group {mode.group_size}", f"group {group}"),
        group_size=group, bytes_per_param=0.5 + 4 / group)


def _int4_group(text: str) -> int:
    """--int4-group's value: a group size the int4 layers and gemlite take."""
    group = int(text) if text.isdigit() else 0
    if group not in (32, 64, 128, 256):
        raise argparse.ArgumentTypeError(f"{text}: one of 32, 64, 128, 256 (a layer whose "
                                         "input features it does not divide stays in bf16)")
    return group


def quality_reference(engine: Engine, model_name: str, positions: int):
    """(token sequences, fp32 log-probabilities) for quality.compare, None when positions is 0."""
    if positions <= 0:
        return None
    from transformers import AutoConfig, AutoTokenizer

    path = engine.registry.resolve(model_name).path
    sequences = quality.sequences(AutoTokenizer.from_pretrained(path), positions)
    # A random checkpoint of a small shape can carry a tokenizer larger than its vocabulary.
    vocab = AutoConfig.from_pretrained(path).get_text_config().vocab_size
    sequences = [[token % vocab for token in sequence] for sequence in sequences]
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    return sequences, quality.fp32_reference(path, sequences, device=device)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m model_utils.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, mode=False, placement_default="cuda:0 with a GPU, else cpu",
                   context=False)
    parser.add_argument("--random-from-config", help="config.json of a shape to build with "
                        "random weights (on the GPU when there is one)")
    parser.add_argument("--modes", default="bf16", help="comma-separated modes, e.g. bf16,nf4")
    parser.add_argument("--batch", default="1", help="comma-separated batch sizes, e.g. 1,8")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--match-prompts", type=int, default=3,
                        help="prompts on which greedy output is compared with plain generate's")
    EngineConfig.add_cli_args(parser, only=("max_batch", "compile", "compiled_rows",
                                            "compile_mode"),
                              defaults={"max_batch": (None, "the largest --batch")})
    parser.add_argument("--no-logprobs", action="store_true",
                        help="skip logprobs_close and logit_error_ratio (an fp32 copy of the "
                             "weights is made for the latter)")
    parser.add_argument("--process-warm-up", action=argparse.BooleanOptionalAction,
                        help="run the first mode once, short and untimed, before measuring "
                             "(default: on the CPU only)")
    parser.add_argument("--quality-positions", type=int, default=381,
                        help="teacher-forced positions for kl_vs_fp32 / top1_vs_fp32 (0: skip)")
    parser.add_argument("--int4-group", type=_int4_group, metavar="N",
                        help="int4-wo in groups of N weights instead of the mode's 128 (this "
                             "run only; the JSON's meta records it)")
    parser.add_argument("--out", default="results.json", help="JSON file to write")
    parser.add_argument("--chart", help="PNG chart (default: next to --out)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        rows = run(args)
    except (ValueError, RuntimeError) as error:
        print(f"bench: {error}", file=sys.stderr)
        return 2
    print("\n" + markdown_table(rows))
    print("\n" + summary_table(rows))
    meta = {"torch": torch.__version__, "cuda": torch.cuda.get_device_name(0)
            if torch.cuda.is_available() else None,
            "int4_group": get_mode("int4-wo").group_size}
    import transformers

    meta["transformers"] = transformers.__version__
    out = Path(args.out)
    out.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2))
    chart = Path(args.chart) if args.chart else out.with_suffix(".png")
    save_chart(rows, chart)
    print(json.dumps([{k: v for k, v in asdict(r).items() if k != "logprobs"} for r in rows]))
    print(f"wrote {out} and {chart}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
