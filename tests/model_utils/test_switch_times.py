"""benchmarks/switch_times.py on a copy of the demo model given as a folder (eager on the CPU):
a cold and a warm phase in their own processes, each switch timed to its first token, its rows
written as they are measured, and what each unload left behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .helpers import copy_demo

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "switch_times.py"


def test_switch_times_reports_each_mode_cold_and_warm_with_the_leftover(tmp_path, demo_path):
    folder = copy_demo(demo_path, tmp_path / "models" / "mine")
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", str(folder),
                           "--modes", "fp32,bf16", "--cycles", "2", "--placement", "cpu",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((out / "switch_times.json").read_text())["rows"]
    seen = [(r["phase"], r["cycle"], r["mode"]) for r in rows]
    assert seen == [("cold", 0, "fp32"), ("cold", 0, "bf16"), ("cold", 1, "(unloaded)"),
                    ("warm", 0, "fp32"), ("warm", 0, "bf16"), ("warm", 1, "fp32"),
                    ("warm", 1, "bf16"), ("warm", 2, "(unloaded)")]
    switches = [r for r in rows if r["mode"] != "(unloaded)"]
    for row in switches:
        assert row["click_to_first_token_s"] >= row["ready_s"] > 0
        assert row["stages"]
        assert "model_kept_by" not in row  # every replaced model was freed
    # Each switch after the first unloaded the mode before it and measured what that left.
    assert all("rss_gb" in r["leftover_gb"] for r in switches if (r["cycle"], r["mode"]) !=
               (0, "fp32"))
    assert all("rss_gb" in r["leftover_gb"] for r in rows if r["mode"] == "(unloaded)")
    # A switch within the model keeps its tokenizer.
    later = [s["stage"] for r in switches if (r["cycle"], r["mode"]) != (0, "fp32")
             for s in r["stages"]]
    assert any(stage.startswith("keeping the tokenizer") for stage in later), later
    # Written as they were measured: the same rows, one JSON line each.
    lines = (out / "rows.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == rows
    assert "| warm | 1 | bf16 |" in (out / "switch_times.md").read_text()
