"""The Model tab's "Modes compared" figures are the benchmark runs' own: every speed ratio is
recomputed from the raw file it names, every quality figure read from its file, and a mode
without a measurement says "not measured"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model_utils.loading.mode_figures import NOT_MEASURED, mode_figures, modes_compared_markdown
from model_utils.loading.modes import MODES

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def candidate_rows(path: str) -> dict[str, dict]:
    """quant_candidates.py's results by candidate."""
    results = json.loads((BENCHMARKS / path).read_text())["results"]
    return {r["candidate"]: r for r in results}


def bench_rows(path: str) -> dict[int, dict]:
    """model_utils.bench's rows of one mode by batch."""
    return {r["batch"]: r for r in json.loads((BENCHMARKS / path).read_text())["rows"]}


def measured_ratios(mode: str, source: str, candidate: str | None = None) -> tuple[float, float]:
    """One reply's and 32 replies' speed against bf16 in the run `source`: the mode's, or the
    candidate's that measured the mode's kernels (before the mode took them)."""
    if source.startswith("h200-2026-11-29/run-m-"):  # the bench, one file per mode
        folder = source.split(",")[0].rsplit("/", 1)[0]
        base, own = bench_rows(f"{folder}/run-m-bf16.json"), bench_rows(f"{folder}/run-m-{mode}.json")
        return (own[1]["tok_s"] / base[1]["tok_s"],
                own[32]["aggregate_tok_s"] / base[32]["aggregate_tok_s"])
    rows = candidate_rows(source)
    own, base = rows[candidate or mode], rows["bf16"]
    return (own["tok_s_1"] / base["tok_s_1"],
            own["aggregate_tok_s_32"] / base["aggregate_tok_s_32"])


@pytest.mark.parametrize("mode", sorted(mode_figures()["speed"]["rows"]))
def test_each_speed_figure_is_its_run_s(mode):
    row = mode_figures()["speed"]["rows"][mode]
    one, many = measured_ratios(mode, row["source"], row.get("candidate"))
    assert (row["one"], row["many"]) == (round(one, 2), round(many, 2))


def test_each_quality_figure_is_its_run_s():
    quality = mode_figures()["quality"]
    measured = {r["mode"]: r for r in
                json.loads((BENCHMARKS / quality["source"]).read_text())["rows"]}
    for mode, row in quality["rows"].items():
        assert row == {"kl": measured[mode]["kl_vs_fp32"], "top1": measured[mode]["top1_vs_fp32"]}


def test_the_table_has_every_mode_and_says_what_was_not_measured():
    table = modes_compared_markdown()
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == list(MODES)
    cells = {row.split("`")[1]: [c.strip() for c in row.split("|")[2:-1]] for row in rows}
    assert cells["bf16"][1:3] == ["1.00x", "1.00x"]
    assert cells["int4-wo"][1:3] == ["1.32x", "0.74x"]
    assert cells["int8-wo"][1:3] == ["1.52x (H100)", "1.01x (H100)"]  # another card, said
    assert cells["fp8"][3:] == ["2.9e-03", "97.2%"]
    assert cells["fp16"][1:] == [NOT_MEASURED, NOT_MEASURED, "3.0e-06", "100.0%"]
    assert "H200" in table and "not a full-size checkpoint" in table
