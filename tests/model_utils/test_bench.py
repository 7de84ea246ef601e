"""The benchmark command runs on the CPU with the demo model and writes what it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {"mode", "batch", "load_s", "weights_gb", "peak_gb", "ttft_ms", "tok_s",
          "aggregate_tok_s", "peer_tok_s", "speedup", "greedy_match", "kv_gb",
          "first_mismatch", "peer_static_first_mismatch"}


def test_bench_writes_table_json_and_chart(tmp_path):
    out = tmp_path / "results.json"
    result = subprocess.run(
        [sys.executable, "-m", "model_utils.bench", "--model", "demo", "--modes", "fp32,nf4",
         "--batch", "1,2", "--prompt-tokens", "16", "--new-tokens", "12",
         "--match-prompts", "2", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| mode | batch |" in result.stdout  # the markdown table
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["batch"]) for r in rows] == [("fp32", 1), ("fp32", 2),
                                                        ("nf4", 1), ("nf4", 2)]
    for row in rows:
        assert FIELDS <= row.keys()
        assert row["greedy_match"] is True, row
        assert row["first_mismatch"] == [None, None]
        assert len(row["peer_static_first_mismatch"]) == 2  # a reference, measured
        assert row["kv_gb"] > 0  # the batch cache the replies were decoded in
        assert row["tok_s"] > 0 and row["peer_tok_s"] > 0
    assert out.with_suffix(".png").stat().st_size > 1000


def test_bench_refuses_an_unknown_mode_with_status_2(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "model_utils.bench", "--modes", "fp8", "--out",
         str(tmp_path / "r.json")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "unknown mode 'fp8'" in result.stderr
