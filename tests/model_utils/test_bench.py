"""The benchmark command runs on the CPU with the demo model and writes what it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {"mode", "batch", "load_s", "weights_gb", "peak_gb", "ttft_ms", "tok_s",
          "aggregate_tok_s", "peer_tok_s", "speedup", "greedy_match", "kv_gb",
          "first_mismatch", "peer_static_first_mismatch", "logprobs_close", "logit_error_ratio"}


def test_bench_writes_table_json_and_chart(tmp_path):
    out = tmp_path / "results.json"
    result = subprocess.run(
        [sys.executable, "-m", "model_utils.bench", "--model", "demo", "--modes",
         "fp32,int4-wo,nf4", "--batch", "1,2", "--prompt-tokens", "16", "--new-tokens", "24",
         "--match-prompts", "2", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| mode | batch |" in result.stdout  # the markdown table
    # Each peer ran with the engine's model gone: nothing of the bench kept it past its unload.
    assert "still alive" not in result.stderr, result.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["batch"]) for r in rows] == [("fp32", 1), ("fp32", 2),
                                                        ("int4-wo", 1), ("int4-wo", 2),
                                                        ("nf4", 1), ("nf4", 2)]
    for row in rows:
        assert FIELDS <= row.keys()
        # Equal tokens are asked in fp32 only; every mode's replies are close by logprobs and
        # no further from fp32 than plain generate's (nf4: from its dequantized weights).
        assert row["greedy_match"] is (True if row["mode"] == "fp32" else None), row
        assert row["logprobs_close"] is True, row["logprobs"]
        assert row["logit_error_ratio"] <= 1.1, row["logprobs"]
        assert len(row["logprobs"]["partings"]) == 2  # 2 prompts alone, or a batch of 2
        for parting in row["logprobs"]["partings"]:  # fp32's view of where the replies part
            assert (parting["reference"] is None) == (parting["index"] is None), parting
            if parting["reference"]:
                assert parting["reference"]["rank_a_token"] >= 0, parting
        if row["mode"] == "fp32":
            assert row["first_mismatch"] == [None, None]
        assert len(row["peer_static_first_mismatch"]) == 2  # a reference, measured
        assert row["kv_gb"] > 0  # the batch cache the replies were decoded in
        assert row["tok_s"] > 0 and row["peer_tok_s"] > 0
    assert out.with_suffix(".png").stat().st_size > 1000
    # Accuracy beside speed: next-token distributions against the fp32 model's.
    quality = {r["mode"]: (r["kl_vs_fp32"], r["top1_vs_fp32"]) for r in rows}
    assert quality["fp32"] == (0.0, 1.0)
    for mode in ("int4-wo", "nf4"):
        # The tiny trained demo model loses something real in 4 bits (int4-wo measured at
        # 0.18 nats, top-1 0.75 on 381 positions); a broken quantizer would be far worse.
        kl, top1 = quality[mode]
        assert 0 < kl < 0.5 and 0.5 < top1 <= 1, (mode, kl, top1)


def test_bench_refuses_an_unknown_mode_with_status_2(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "model_utils.bench", "--modes", "int3", "--out",
         str(tmp_path / "r.json")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "unknown mode 'int3'" in result.stderr


def test_a_table_with_differing_greedy_tokens_says_where_and_gives_the_reference():
    from model_utils.bench.report import BenchRow, markdown_table

    row = BenchRow(mode="bf16", batch=1, decode_path="static", load_s=1.0, weights_gb=14.2,
                   peak_gb={"cuda:0": 16.3}, peak_reserved_gb={}, kv_gb=1.8,
                   over_weights_kv_pct=2.0, memory_stages={}, ttft_ms=8.5, tok_s=210.0,
                   aggregate_tok_s=210.0, x_one_plain=6.1, stream_tok_s=205.0, peer_load_s=3.0,
                   peer_ttft_ms=26.0, peer_tok_s=34.5, peer_aggregate_tok_s=34.5, speedup=6.1,
                   ttft_ratio=0.33, greedy_match=False, first_mismatch=[7, None, 6],
                   peer_static_first_mismatch=[2, 4, 11])
    text = markdown_table([row])
    assert "at token 7, none, 6" in text and "static cache differs from plain generate at " \
        "token 2, 4, 11" in text
    assert "low precision" in text
    fp32 = BenchRow(**{**row.__dict__, "mode": "fp32"})
    assert "worth reporting" in markdown_table([fp32])
    matching = BenchRow(**{**row.__dict__, "greedy_match": True, "first_mismatch": [None]})
    assert "first differ" not in markdown_table([matching])
    parted = BenchRow(**{**row.__dict__, "logprobs_close": False})
    assert "NOT close" in markdown_table([parted])


def test_the_summary_shows_units_and_a_dash_where_a_figure_does_not_apply():
    from model_utils.bench.report import BenchRow, summary_table

    row = BenchRow(mode="nf4", batch=1, decode_path="eager", load_s=1.0, weights_gb=0.1,
                   peak_gb={"cpu_rss": 0.5}, peak_reserved_gb={}, kv_gb=0.01,
                   over_weights_kv_pct=None, memory_stages={}, ttft_ms=12.345, tok_s=250.0,
                   aggregate_tok_s=250.0, x_one_plain=1.2, stream_tok_s=None, peer_load_s=0.1,
                   peer_ttft_ms=10.0, peer_tok_s=200.0, peer_aggregate_tok_s=200.0,
                   speedup=1.25, ttft_ratio=1.2, greedy_match=None, first_mismatch=[3],
                   peer_static_first_mismatch=[None], logprobs_close=True,
                   logit_error_ratio=None)
    header, _, line = summary_table([row]).splitlines()
    assert "Time to first token (ms)" in header and "Peak GB" in header
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells == ["nf4", "1", "12.35", "250", "-", "1.25", "yes", "-", "0.50"]


def test_int4_group_replaces_the_modes_group_in_this_process_only(monkeypatch):
    from model_utils.bench.run import use_int4_group
    from model_utils.loading import modes

    monkeypatch.setitem(modes.MODES, "int4-wo", modes.MODES["int4-wo"])  # restored after
    use_int4_group(64)
    mode = modes.get_mode("int4-wo")  # what every load of the mode reads
    assert (mode.group_size, mode.bytes_per_param) == (64, 0.5 + 4 / 64)
    assert "group 64" in mode.label and "group 128" not in mode.label


def test_bench_refuses_a_group_size_the_kernels_do_not_take(tmp_path):
    for group in ("48", "0", "512"):
        result = subprocess.run(
            [sys.executable, "-m", "model_utils.bench", "--modes", "int4-wo", "--int4-group",
             group, "--out", str(tmp_path / "r.json")], cwd=ROOT, capture_output=True,
            text=True, timeout=120)
        assert result.returncode == 2
        assert f"--int4-group: {group}: one of 32, 64, 128, 256" in result.stderr
