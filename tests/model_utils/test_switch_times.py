"""benchmarks/switch_times.py on a copy of the demo model given as a folder (eager on the CPU):
a cold and a warm phase in their own processes, each switch timed to its first token, its rows
written as they are measured, and what each unload left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .helpers import copy_demo

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "switch_times.py"


def test_switch_times_reports_each_mode_cold_and_warm_with_the_leftover(tmp_path, demo_path):
    copy_demo(demo_path, tmp_path / "models" / "mine")
    out = tmp_path / "out"
    # The folder as given, relative to where the command runs: no models folder, no
    # QWEN_CHAT_CACHE pointing at its parent.
    env = {k: v for k, v in os.environ.items() if k != "QWEN_CHAT_CACHE"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", "models/mine",
                           "--modes", "fp32,bf16", "--cycles", "2", "--placement", "cpu",
                           "--out", str(out)], cwd=tmp_path, env=env,
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
    # Printed: the table, then the summary as one JSON line.
    printed = done.stdout.strip().splitlines()
    assert "| warm | 1 | bf16 |" in done.stdout
    summary = json.loads(printed[-1])
    assert [len(summary["click_to_first_token_s"][phase][mode]) for phase in ("cold", "warm")
            for mode in ("fp32", "bf16")] == [1, 1, 2, 2]
    assert set(summary["leftover_after_last_unload_gb"]) == {"cold", "warm"}


def test_a_killed_run_keeps_what_it_measured(tmp_path, demo_path):
    folder = copy_demo(demo_path, tmp_path / "models" / "mine")
    out = tmp_path / "out"
    rows_file = out / "rows.jsonl"
    run = subprocess.Popen([sys.executable, str(SCRIPT), "--model", str(folder), "--modes",
                            "fp32,bf16", "--cycles", "3", "--placement", "cpu", "--out",
                            str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)  # its own group: its phases die with it
    try:
        deadline = time.monotonic() + 300
        while not (rows_file.exists() and rows_file.read_text().count("\n") >= 2):
            assert run.poll() is None, "the run ended before it measured two switches"
            assert time.monotonic() < deadline, "no two rows in 300 s"
            time.sleep(0.2)
    finally:
        os.killpg(run.pid, signal.SIGKILL)  # the run and the phase it is in, at once
        run.wait()
    lines = rows_file.read_text().splitlines()
    rows = [json.loads(line) for line in lines]  # every line whole: written one at a time
    assert [(r["phase"], r["cycle"], r["mode"]) for r in rows[:2]] == [("cold", 0, "fp32"),
                                                                        ("cold", 0, "bf16")]
    assert not (out / "switch_times.json").exists()

    # What it measured, as the table and JSON of a run that ended.
    done = subprocess.run([sys.executable, str(SCRIPT), "--report", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| cold | 0 | bf16 |" in done.stdout
    assert json.loads((out / "switch_times.json").read_text())["rows"] == rows
    assert json.loads(done.stdout.strip().splitlines()[-1])["click_to_first_token_s"]["cold"]


def test_a_phase_that_fails_writes_what_was_measured_and_says_why(tmp_path):
    out = tmp_path / "out"
    # One second: the cold phase's process is killed before its first load ends.
    done = subprocess.run([sys.executable, str(SCRIPT), "--modes", "fp32", "--cycles", "1",
                           "--placement", "cpu", "--timeout", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 1
    assert "the cold phase failed" in done.stderr and "timed out after 1 s" in done.stderr
    assert "(no switch was measured)" in done.stdout
    assert json.loads((out / "switch_times.json").read_text())["rows"] == []
