"""What each mode was measured to cost, for the page where a user picks one.

The figures are copied from the benchmark runs named in data/mode_figures.json (BENCHMARKS.md
has the runs; tests/model_utils/test_mode_figures.py checks each figure against its raw file),
so the Model tab can say, beside the dropdown, how much slower or less exact a mode was, not
only how many bytes it takes. A mode without a measurement says so instead of a guess.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from .modes import MODES

FIGURES_FILE = Path(__file__).with_name("data") / "mode_figures.json"
NOT_MEASURED = "not measured"


@cache
def mode_figures() -> dict:
    return json.loads(FIGURES_FILE.read_text())


def _times(value: float | None, gpu: str | None = None) -> str:
    if value is None:
        return NOT_MEASURED
    return f"{value:.2f}x ({gpu})" if gpu else f"{value:.2f}x"


def _kl(value: float | None) -> str:
    return NOT_MEASURED if value is None else f"{value:.1e}"


def modes_compared_markdown() -> str:
    """A Markdown table, one row per mode of the dropdown: its memory, its speed against bf16
    for one reply and for 32 at once, and its KL and top-1 agreement against fp32; the
    conditions of each measurement under the table."""
    figures = mode_figures()
    speed, quality = figures["speed"]["rows"], figures["quality"]["rows"]
    lines = ["| mode | bytes / parameter | one reply x bf16 | 32 replies x bf16 | "
             "KL vs fp32 | top-1 vs fp32 |", "|---|---|---|---|---|---|"]
    for mode in MODES.values():
        fast = speed.get(mode.name, {"one": 1.0, "many": 1.0} if mode.name == "bf16" else {})
        exact = quality.get(mode.name, {"kl": 0.0, "top1": 1.0} if mode.name == "fp32" else {})
        top1 = exact.get("top1")
        lines.append(f"| `{mode.name}` | {mode.bytes_per_param:.2f} "
                     f"| {_times(fast.get('one'), fast.get('gpu'))} "
                     f"| {_times(fast.get('many'), fast.get('gpu'))} | {_kl(exact.get('kl'))} "
                     f"| {NOT_MEASURED if top1 is None else f'{top1:.1%}'} |")
    return "\n".join(lines + [
        "",
        f"Speed: {figures['speed']['what']}; {figures['speed']['where']}.",
        f"Quality: {figures['quality']['what']}; {figures['quality']['where']}.",
        "BENCHMARKS.md has the runs.",
    ])
