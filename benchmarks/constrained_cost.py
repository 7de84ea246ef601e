"""What constrained decoding costs: a reply held to a JSON schema against a free one, alone and
beside free replies (a batch with a constrained row reads each step before the next, so its
free rows lose the overlap of host and device too).

    .venv/bin/python benchmarks/constrained_cost.py [--model demo --mode fp32 --tokens 64]

Greedy, through the engine; prints a table and writes JSON (--out). On a GPU pass
--placement cuda:0 and a real or --random-from-config model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from model_utils.bench.inputs import build_random_model  # noqa: E402
from model_utils.bench.measure import settle  # noqa: E402
from model_utils.engine_config import EngineConfig  # noqa: E402
from model_utils.engine_factory import build_engine  # noqa: E402
from model_utils.loading.loaded_model import LoadRequest
from model_utils.loading.placement import Placement  # noqa: E402
from model_utils.runtime.generation_settings import GenerationSettings
from model_utils.runtime.grammar import OutputFormat  # noqa: E402

# Bounded values only: a random or tiny model still closes the object within the limit.
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 200},
    "days": {"type": "integer"}, "sunny": {"type": "boolean"}},
    "required": ["city", "days", "sunny"]}
ASK = [{"role": "user", "content": "Describe the weather in Paris in detail."}]


def one(engine, tokens: int, fmt: OutputFormat | None):
    settings = GenerationSettings(max_new_tokens=tokens, min_new_tokens=0, temperature=0.0)
    return engine.generate_text(ASK, settings, thinking=False, output_format=fmt).stats


def together(engine, tokens: int, fmts: list) -> list:
    results = [None] * len(fmts)
    barrier = threading.Barrier(len(fmts))

    def run(i):
        barrier.wait()
        results[i] = one(engine, tokens, fmts[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fmts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--random-from-config")
    parser.add_argument("--mode", default="fp32")
    parser.add_argument("--placement", default="cpu")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="constrained_cost.json")
    args = parser.parse_args(argv)
    model = args.model
    if args.random_from_config:
        model = tempfile.mkdtemp(prefix="constrained-")
        build_random_model(Path(args.random_from_config), Path(model),
                           "cuda" if args.placement.startswith("cuda") else "cpu")
    engine = build_engine(EngineConfig(max_batch=max(args.streams, 1)))
    if model != "demo":
        engine.registry.allow_root(model)
    engine.load(LoadRequest(model, args.mode, Placement(args.placement)))
    settle(engine)  # the graphs the load left for idle time, before anything is timed
    fmt = OutputFormat("json_schema", SCHEMA)
    one(engine, 8, None), one(engine, 8, fmt)  # warm-up: compile the grammar's tokenizer info
    rows = {}
    for name, run in [
        ("free, alone", lambda: [one(engine, args.tokens, None)]),
        ("json_schema, alone", lambda: [one(engine, args.tokens, fmt)]),
        (f"{args.streams} free together", lambda: together(engine, args.tokens,
                                                           [None] * args.streams)),
        (f"{args.streams - 1} free beside 1 json_schema",
         lambda: together(engine, args.tokens, [None] * (args.streams - 1) + [fmt])),
    ]:
        speeds = []
        for _ in range(args.repeats):
            stats = run()
            speeds.append(statistics.median(s.tok_s for s in stats))
        rows[name] = {"tok_s_per_reply": round(statistics.median(speeds), 1),
                      "tokens": [s.new_tokens for s in stats]}
    free = rows["free, alone"]["tok_s_per_reply"]
    held = rows["json_schema, alone"]["tok_s_per_reply"]
    print("| case | tok/s per reply | tokens |\n|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['tok_s_per_reply']} | {row['tokens']} |")
    print(f"\nconstrained alone: {held / free:.2f}x of free "
          f"({1000 / held - 1000 / free:.2f} ms more per token)")
    result = {"rows": rows, "model": model, "mode": args.mode, "placement": args.placement,
              "date": time.strftime("%Y-%m-%d")}
    Path(args.out).write_text(json.dumps(result, indent=1))
    engine.unload()
    return 0


if __name__ == "__main__":
    sys.exit(main())
