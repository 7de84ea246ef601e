"""Switching modes: the wait from a Load click to the first token, per mode, cold and warm, and
the memory each unload leaves behind over many cycles.

Each phase runs in a new process (the app's own situation after a restart), through the engine
as the Model tab drives it (load, one greedy token, unload):

    cold    an empty compile cache: every mode compiles afresh
    warm    the same cache, a new process: "a mode used before, any earlier process"
            (the first cycle's figures), then the rest of --cycles cycles through the modes

After every unload the counters (torch's allocated and reserved memory per GPU, NVML's used
memory per GPU, the process's RSS) are compared with those before the phase's first load: what
a day of switching would eat. Targets (Qwen2.5-7B shape, H200): warm <= 15 s, cold <= 30 s,
leftover within 64 MB after 20 cycles.

    python benchmarks/switch_times.py --model /tmp/r7b --modes bf16,nf4,int4-wo \
        --cycles 20 --out "$OUT"                   # on the GPU host
    python benchmarks/switch_times.py --out /tmp/st   # on a CPU: the demo model, eager

Writes OUT/switch_times.json and OUT/switch_times.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def counters() -> dict[str, float]:
    """Memory now, in GB: torch's allocated and reserved and NVML's used per GPU, and RSS."""
    from model_utils.memory import take_snapshot

    snapshot = take_snapshot()
    now = {"rss_gb": snapshot.process_rss_gb}
    for gpu in snapshot.gpus:
        now[f"cuda:{gpu.index}_allocated_gb"] = gpu.allocated_gb
        now[f"cuda:{gpu.index}_reserved_gb"] = gpu.reserved_gb
        if gpu.used_gb is not None:
            now[f"cuda:{gpu.index}_nvml_used_gb"] = gpu.used_gb
    return now


def one_phase(model: str, modes: list[str], cycles: int, placement: str) -> list[dict]:
    """In this process: `cycles` rounds of load -> first token -> unload for every mode."""
    from model_utils import process_tuning
    from model_utils.engine_config import EngineConfig
    from model_utils.loading.manager import LoadRequest
    from model_utils.loading.placement import Placement
    from model_utils.runtime.generation_settings import GenerationSettings

    process_tuning.tune_process()  # as app.py: the compile cache of TORCHINDUCTOR_CACHE_DIR
    engine = EngineConfig().build()
    baseline, rows = counters(), []
    for cycle in range(cycles):
        for mode in modes:
            start = time.perf_counter()
            status = engine.load(LoadRequest(model=model, mode=mode,
                                             placement=Placement(placement)))
            for _ in engine.chat([{"role": "user", "content": "Hello"}],
                                 GenerationSettings.greedy(max_new_tokens=1)):
                break  # the first update: the first token is on its way to the page
            first_token_s = time.perf_counter() - start
            engine.unload()
            after = counters()
            rows.append({
                "cycle": cycle, "mode": mode, "click_to_first_token_s": round(first_token_s, 2),
                "ready_s": status.get("ready_s"), "stages": status.get("load_stages"),
                "compiled_graphs": status.get("compiled_graphs", {}),
                "decode_path": status.get("decode_path"),
                "leftover_gb": {k: round(after.get(k, 0.0) - v, 4) for k, v in baseline.items()},
            })
            print(json.dumps(rows[-1]), flush=True)
    return rows


def run_phase(name: str, args, cache: Path) -> list[dict]:
    env_cache = {"TORCHINDUCTOR_CACHE_DIR": str(cache)}
    cycles = 1 if name == "cold" else args.cycles
    command = [sys.executable, __file__, "--phase", "--model", args.model, "--modes", args.modes,
               "--cycles", str(cycles), "--placement", args.placement]
    done = subprocess.run(command, env={**os.environ, **env_cache}, capture_output=True,
                          text=True, timeout=args.timeout, check=False)
    (args.out / f"{name}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"the {name} phase failed (see {args.out / f'{name}.log'}):\n"
                         + done.stderr[-3000:])
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return [{**row, "phase": name} for row in rows]


def report(rows: list[dict]) -> str:
    lines = ["| phase | cycle | mode | click to first token (s) | ready (s) | graphs cached / "
             "compiled | longest stages |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        if row["phase"] == "warm" and 0 < row["cycle"] < max(r["cycle"] for r in rows):
            continue  # the middle cycles: in the JSON
        graphs = row["compiled_graphs"]
        cached = f"{graphs.get('hits', 0)} / {graphs.get('misses', 0)}" if graphs else "-"
        stages = sorted(row["stages"] or [], key=lambda s: -s["s"])[:3]
        longest = ", ".join(f"{s['stage']} {s['s']:.1f}" for s in stages)
        lines.append(f"| {row['phase']} | {row['cycle']} | {row['mode']} | "
                     f"{row['click_to_first_token_s']:.2f} | {row['ready_s']:.2f} | {cached} | "
                     f"{longest} |")
    last = rows[-1]["leftover_gb"]
    lines.append("")
    lines.append("Left over after the last unload against before the warm phase's first load "
                 "(GB): " + ", ".join(f"{k} {v:+.4f}" for k, v in last.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--modes", default="fp32,bf16", help="comma-separated, in switching order")
    p.add_argument("--cycles", type=int, default=2, help="warm cycles through the modes")
    p.add_argument("--placement", default="auto", help="cpu, cuda:0, auto (default)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--timeout", type=int, default=3600, help="seconds a phase may take")
    p.add_argument("--phase", action="store_true", help=argparse.SUPPRESS)  # the child
    args = p.parse_args(argv)
    if args.placement == "auto":
        import torch

        args.placement = "cuda:0" if torch.cuda.is_available() else "cpu"
    if args.phase:
        one_phase(args.model, args.modes.split(","), args.cycles, args.placement)
        return 0
    args.out = args.out or Path(tempfile.mkdtemp(prefix="switch-times-"))
    args.out.mkdir(parents=True, exist_ok=True)
    cache = Path(tempfile.mkdtemp(prefix="compile-cache-"))  # empty: the cold phase is cold
    rows = run_phase("cold", args, cache) + run_phase("warm", args, cache)
    (args.out / "switch_times.json").write_text(json.dumps(
        {"model": args.model, "placement": args.placement, "rows": rows}, indent=1))
    table = report(rows)
    (args.out / "switch_times.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
