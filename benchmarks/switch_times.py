"""Switching modes: the wait from a Load click to the first token, per mode, cold and warm, and
the memory each switch leaves behind over many cycles.

Each phase runs in a new process (the app's own situation after a restart), through the engine
as the Model tab drives it: a load while another mode is loaded (the switch unloads it first),
then one greedy token; the next click waits until the work the load left for idle time is
done (with --compile-while-idle, the compiled decode step), as a user reading the reply would,
and that moment is a column of its own ("idle work done", from the click):

    cold    an empty compile cache: every mode compiles afresh
    warm    the same cache, a new process: "a mode used before, any earlier process"
            (the first cycle's figures), then the rest of --cycles cycles through the modes
            ("back to a mode used earlier in the same process")

After every switch's unload the counters (torch's allocated and reserved memory per GPU, the
process's RSS) are compared with those before the phase's first load, and after the phase's
last unload NVML's used memory per GPU too: what a day of switching would eat. Targets
(Qwen2.5-7B shape, H200): back to a mode of the same process <= 3 s, a mode compiled in an
earlier process <= 10 s, cold <= 25 s; leftover within 64 MB after 20 cycles.

    python benchmarks/switch_times.py --random-from-config \
        benchmarks/configs/qwen2.5-7b-instruct.config.json --modes bf16,nf4,int4-wo \
        --cycles 20 --out "$OUT"                   # on the GPU host
    python benchmarks/switch_times.py --model /models/Qwen2.5-7B-Instruct ...  # a folder
    python benchmarks/switch_times.py --out /tmp/st   # on a CPU: the demo model, eager

Writes OUT/rows.jsonl as it goes (a killed run keeps what it measured), then
OUT/switch_times.json and OUT/switch_times.md, and prints the table and a JSON summary (per
phase and mode, the seconds of each switch; what the last unload left). A phase that fails
writes and prints what was measured before it, then exits with an error. After a killed run:

    python benchmarks/switch_times.py --report --out DIR   # the table and JSON of DIR's rows
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
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


def one_phase(model: str, modes: list[str], cycles: int, placement: str, rows_file: Path,
              phase: str, park_gb: int = 0, compile_while_idle: bool = False) -> None:
    """In this process: `cycles` rounds of switching to every mode and its first token, each
    row appended to `rows_file` as soon as it is measured."""
    from model_utils import process_tuning
    from model_utils.bench.measure import settle
    from model_utils.engine_config import EngineConfig
    from model_utils.engine_factory import build_engine
    from model_utils.loading.loaded_model import LoadRequest
    from model_utils.loading.placement import Placement
    from model_utils.runtime.generation_settings import GenerationSettings

    process_tuning.tune_process()  # as app.py: the compile cache of TORCHINDUCTOR_CACHE_DIR
    # The load's and unload's own lines (what parking, stopping the serving and the garbage
    # collector took) and the preparation's (each capture's seconds, which forward the one-row
    # step kept) go to the phase's log, time-stamped to the millisecond.
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    for package in ("model_utils.loading", "model_utils.runtime"):
        logging.getLogger(package).setLevel(logging.INFO)
    engine = build_engine(EngineConfig(park_gb=park_gb, compile_while_idle=compile_while_idle))
    if model != "demo":
        engine.registry.allow_root(model)  # a folder given on the command line, as the bench
    baseline = counters()

    def write(row: dict) -> None:
        with rows_file.open("a") as out:
            out.write(json.dumps({**row, "phase": phase}) + "\n")

    for cycle in range(cycles):
        for mode in modes:
            start = time.perf_counter()
            status = engine.load(LoadRequest(model=model, mode=mode,
                                             placement=Placement(placement)))
            loaded_s = time.perf_counter() - start
            for _ in engine.chat([{"role": "user", "content": "Hello"}],
                                 GenerationSettings.greedy(max_new_tokens=1)):
                break  # the first update: the first token is on its way to the page
            first_token_s = time.perf_counter() - start
            # What the load left for idle time (--compile-while-idle: the compiled step) ends
            # before the next click, as it would while a user reads the reply: the next
            # switch measures its own wait, not this one's leftovers.
            settle(engine)
            settled_s = time.perf_counter() - start
            unload = engine.manager.last_unload  # the switch's own, when it replaced a mode
            switch = status.get("last_switch", {})
            # Beside the load's own stages (ready_s): the unload of the mode it replaced (with
            # --park-gb, the copy to host memory) and the first reply's wait after the load.
            # Seconds to the millisecond, as the status keeps ready_s and unload_s.
            row = {"cycle": cycle, "mode": mode,
                   "click_to_first_token_s": round(first_token_s, 3),
                   "ready_s": status.get("ready_s"), "unload_s": switch.get("unload_s"),
                   "load_returned_s": round(loaded_s, 3),
                   "first_token_after_load_s": round(first_token_s - loaded_s, 3),
                   "settled_s": round(settled_s, 3),
                   "stages": status.get("load_stages"),
                   "compiled_graphs": status.get("compiled_graphs", {}),
                   "from_caches": switch.get("from_caches", []),
                   "decode_path": status.get("decode_path")}
            if unload is not None and (cycle, mode) != (0, modes[0]):
                row["leftover_gb"] = {k: round(unload.after.get(k, 0.0) - v, 4)
                                      for k, v in baseline.items() if k in unload.after}
                if unload.model_kept_by:
                    row["model_kept_by"] = unload.model_kept_by
            write(row)
    engine.unload()
    after = counters()
    write({"cycle": cycles, "mode": "(unloaded)",
           "leftover_gb": {k: round(after.get(k, 0.0) - v, 4) for k, v in baseline.items()}})


def model_as_given(model: str) -> str:
    """A folder named on the command line, relative ("models/Qwen2.5-7B") or not, as the
    absolute path the engine loads: a bare relative name would read as a hub id or a name
    under a models folder. Anything else ('demo', a hub id) goes on as it is."""
    path = Path(model).expanduser()
    return str(path.resolve()) if model != "demo" and path.is_dir() else model


def run_phase(name: str, args, cache: Path) -> list[dict]:
    env_cache = {"TORCHINDUCTOR_CACHE_DIR": str(cache)}
    cycles = 1 if name == "cold" else args.cycles
    rows_file = args.out / "rows.jsonl"
    command = [sys.executable, __file__, "--phase", name, "--model", args.model,
               "--modes", args.modes, "--cycles", str(cycles), "--placement", args.placement,
               "--park-gb", str(args.park_gb), "--out", str(args.out)] + \
        (["--compile-while-idle"] if args.compile_while_idle else [])
    try:
        done = subprocess.run(command, env={**os.environ, **env_cache}, capture_output=True,
                              text=True, timeout=args.timeout, check=False)
        failed = done.returncode != 0
        log = done.stdout + done.stderr
    except subprocess.TimeoutExpired as error:
        failed, log = True, f"timed out after {args.timeout} s\n{error.stderr or ''}"
    (args.out / f"{name}.log").write_text(log)
    if failed:
        raise PhaseFailed(f"the {name} phase failed (see {args.out / f'{name}.log'}; its rows "
                          f"so far are in {rows_file}):\n" + log[-3000:])
    return [row for row in read_rows(rows_file) if row["phase"] == name]


class PhaseFailed(RuntimeError):
    pass


def read_rows(rows_file: Path) -> list[dict]:
    return [json.loads(line) for line in rows_file.read_text().splitlines() if line.strip()] \
        if rows_file.exists() else []


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"  # rows of earlier runs lack the column


def report(rows: list[dict]) -> str:
    lines = ["| phase | cycle | mode | click to first token (s) | unload (s) | ready (s) | "
             "first token after the load (s) | idle work done (s) | graphs cached / compiled | "
             "longest stages |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    switches = [r for r in rows if "click_to_first_token_s" in r]
    last_cycle = max((r["cycle"] for r in switches), default=0)
    for row in switches:
        if row["phase"] == "warm" and 0 < row["cycle"] < last_cycle:
            continue  # the middle cycles: in the JSON
        graphs = row["compiled_graphs"]
        cached = ("kept in the process" if graphs.get("kept") else
                  f"{graphs.get('hits', 0)} / {graphs.get('misses', 0)}") if graphs else "-"
        stages = sorted(row["stages"] or [], key=lambda s: -s["s"])[:3]
        longest = ", ".join(f"{s['stage']} {s['s']:.1f}" for s in stages)
        lines.append(f"| {row['phase']} | {row['cycle']} | {row['mode']} | "
                     f"{row['click_to_first_token_s']:.2f} | {_seconds(row.get('unload_s'))} | "
                     f"{row['ready_s']:.2f} | {_seconds(row.get('first_token_after_load_s'))} | "
                     f"{_seconds(row.get('settled_s'))} | {cached} | {longest} |")
    unloads = [r for r in rows if r["mode"] == "(unloaded)"]
    if unloads:  # a run killed or failed mid-phase has none for that phase
        lines.append("")
        lines.append(f"Left over after the {unloads[-1]['phase']} phase's last unload against "
                     "before its first load (GB): " +
                     ", ".join(f"{k} {v:+.4f}" for k, v in unloads[-1]["leftover_gb"].items()))
    kept = [r for r in rows if r.get("model_kept_by")]
    if kept:
        lines.append(f"The unloaded model was still alive after {len(kept)} switch(es), kept by: "
                     + "; ".join(kept[0]["model_kept_by"]))
    return "\n".join(lines)


def summary(rows: list[dict]) -> dict:
    """Per phase and mode, the click-to-first-token seconds of each switch in order; per phase,
    what its last unload left (GB): the printed JSON."""
    times: dict[str, dict[str, list[float]]] = {}
    left: dict[str, dict] = {}
    for row in rows:
        if "click_to_first_token_s" in row:
            times.setdefault(row["phase"], {}).setdefault(row["mode"], []).append(
                row["click_to_first_token_s"])
        elif row["mode"] == "(unloaded)":
            left[row["phase"]] = row["leftover_gb"]
    return {"click_to_first_token_s": times, "leftover_after_last_unload_gb": left}


def write_report(args, rows: list[dict]) -> None:
    """OUT/switch_times.json and .md from `rows`, and the table and summary printed."""
    (args.out / "switch_times.json").write_text(json.dumps(
        {"model": args.model, "placement": args.placement, "rows": rows}, indent=1))
    table = report(rows) if rows else "(no switch was measured)"
    (args.out / "switch_times.md").write_text(table + "\n")
    print(table)
    print(json.dumps(summary(rows)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo", help="'demo', a model folder, or a hub id in the "
                   "local cache")
    p.add_argument("--random-from-config", type=Path, default=None,
                   help="config.json of a shape to build with random weights and switch on")
    p.add_argument("--modes", default="fp32,bf16", help="comma-separated, in switching order")
    p.add_argument("--cycles", type=int, default=2, help="warm cycles through the modes")
    p.add_argument("--placement", default="auto", help="cpu, cuda:0, auto (default)")
    p.add_argument("--park-gb", type=int, default=0, help="the engine's --park-gb: host memory "
                   "for the models a switch replaces (default 0: off)")
    p.add_argument("--compile-while-idle", action="store_true",
                   help="the engine's --compile-while-idle: a step not compiled in the process "
                        "yet is compiled after the load, while no reply decodes")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--timeout", type=int, default=3600, help="seconds a phase may take")
    p.add_argument("--report", action="store_true", help="measure nothing: the table and JSON "
                   "of the rows already in --out (a killed run's)")
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)  # the child: its name
    args = p.parse_args(argv)
    if args.placement == "auto":
        import torch

        args.placement = "cuda:0" if torch.cuda.is_available() else "cpu"
    if args.phase:
        one_phase(args.model, args.modes.split(","), args.cycles, args.placement,
                  args.out / "rows.jsonl", args.phase, args.park_gb, args.compile_while_idle)
        return 0
    if args.report:
        if args.out is None:
            p.error("--report needs --out: the folder of the run")
        write_report(args, read_rows(args.out / "rows.jsonl"))
        return 0
    args.model = model_as_given(args.model)
    args.out = args.out or Path(tempfile.mkdtemp(prefix="switch-times-"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rows.jsonl").unlink(missing_ok=True)
    if args.random_from_config:
        from model_utils.bench.inputs import build_random_model

        device = "cuda" if args.placement.startswith("cuda") else "cpu"
        args.model = str(build_random_model(args.random_from_config,
                                            Path(tempfile.mkdtemp(prefix="switch-model-")),
                                            device))
    cache = Path(tempfile.mkdtemp(prefix="compile-cache-"))  # empty: the cold phase is cold
    try:
        rows = run_phase("cold", args, cache) + run_phase("warm", args, cache)
    except PhaseFailed as failed:
        write_report(args, read_rows(args.out / "rows.jsonl"))  # what it measured before
        print(failed, file=sys.stderr)
        return 1
    finally:
        # What gemlite tuned for this GPU (layers/gemlite_weights.save_tuned), to ship for it.
        for tuned in cache.glob("gemlite-*.json"):
            shutil.copy(tuned, args.out / tuned.name)
    write_report(args, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
