"""benchmarks/switch_times.py on the demo model (eager on the CPU): a cold and a warm phase in
their own processes, each load timed to its first token, and what each unload left behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "switch_times.py"


def test_switch_times_reports_each_mode_cold_and_warm_with_the_leftover(tmp_path, demo_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--modes", "fp32,bf16", "--cycles", "2",
                           "--placement", "cpu", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "switch_times.json").read_text())["rows"]
    seen = [(r["phase"], r["cycle"], r["mode"]) for r in rows]
    assert seen == [("cold", 0, "fp32"), ("cold", 0, "bf16"), ("warm", 0, "fp32"),
                    ("warm", 0, "bf16"), ("warm", 1, "fp32"), ("warm", 1, "bf16")]
    for row in rows:
        assert row["click_to_first_token_s"] >= row["ready_s"] > 0
        assert row["stages"] and "rss_gb" in row["leftover_gb"]
    assert "| warm | 1 | bf16 |" in (tmp_path / "switch_times.md").read_text()
