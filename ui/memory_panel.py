"""The memory panel: a card per GPU (NVML used/total, torch allocated/reserved), CPU RAM and
process RSS, the loaded model's weights, refreshed by a timer, and a plot of the last minutes.

The figures come from the engine's one background sampler (engine.memory): the panel only
reads the history, so a page open or closed changes nothing in what is recorded.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

import gradio as gr

from model_utils.memory import MemorySnapshot
from server.model_actions import still_held

from .memory_plot import memory_svg

if TYPE_CHECKING:
    from model_utils.engine import Engine

REFRESH_S = 2.0
WINDOW_S = 300  # the plot shows the last five minutes

_CARD = ("<div class='mem-card' style='border:1px solid var(--border-color-primary);"
         "border-radius:8px;padding:8px 12px;min-width:190px;flex:1'>"
         "<div style='font-weight:600'>{title}</div>{rows}</div>")


def build_memory_panel(engine: Engine) -> dict:
    c: dict = {}
    c["cards"] = gr.HTML(memory_cards(engine.memory.latest(), engine.status()),
                         elem_id="memory-cards")
    c["plot"] = gr.HTML(memory_svg(engine.memory.points(), window_s=WINDOW_S),
                        elem_id="memory-plot")
    c["timer"] = gr.Timer(REFRESH_S)

    def refresh():
        return (memory_cards(engine.memory.latest(), engine.status()),
                memory_svg(engine.memory.points(), window_s=WINDOW_S))

    c["timer"].tick(refresh, None, [c["cards"], c["plot"]],
                    api_visibility="private", show_progress="hidden", concurrency_limit=None)
    return c


def fmt_gb(gb: float | None) -> str:
    if gb is None:
        return "n/a"
    return f"{gb * 1024:.1f} MB" if gb < 0.1 else f"{gb:.2f} GB"


def _row(name: str, value: str) -> str:
    return f"<div>{html.escape(name)}: <b>{html.escape(value)}</b></div>"


def memory_cards(snapshot: MemorySnapshot, status: dict) -> str:
    cards = []
    for gpu in snapshot.gpus:
        rows = [_row("used (NVML, all processes)",
                     f"{fmt_gb(gpu.used_gb)} / {fmt_gb(gpu.total_gb)}"),
                _row("torch allocated", fmt_gb(gpu.allocated_gb)),
                _row("torch reserved", fmt_gb(gpu.reserved_gb))]
        cards.append(_CARD.format(title=html.escape(f"cuda:{gpu.index} {gpu.name}"),
                                  rows="".join(rows)))
    cards.append(_CARD.format(title="CPU", rows=_row(
        "RAM used", f"{fmt_gb(snapshot.cpu_used_gb)} / {fmt_gb(snapshot.cpu_total_gb)}")
        + _row("this process (RSS)", fmt_gb(snapshot.process_rss_gb))))
    if status.get("loaded"):
        where = ", ".join(f"{d} {fmt_gb(e.get('gb', 0))}"
                          for d, e in (status.get("device_map") or {}).items())
        model_rows = (_row("model", f"{status['model']} ({status['mode']})")
                      + _row("weights", f"{fmt_gb(status.get('footprint_gb'))} ({where})"))
        if status.get("kv_cache_gb"):  # allocated with the first reply where not warmed up
            model_rows += _row("KV cache", fmt_gb(status["kv_cache_gb"]))
        if blocks := status.get("kv_blocks"):
            model_rows += _row("KV blocks (tokens)", kv_blocks_line(blocks))
        ready = (status.get("memory_stages") or {}).get("ready")
        if ready:  # after the decode and prefill graphs were captured
            model_rows += _row("ready to serve (allocated / reserved)",
                               f"{fmt_gb(ready['allocated_gb'])} / "
                               f"{fmt_gb(ready['reserved_gb'])}")
    else:
        model_rows = _row("model", "none loaded")
        if last := status.get("last_unload"):  # did the memory come back?
            model_rows += _row(f"after unloading {last['model']}", still_held(last))
    cards.append(_CARD.format(title="Loaded model", rows=model_rows))
    note = f"<p><i>{html.escape(snapshot.note)}</i></p>" if snapshot.note else ""
    return note + "<div style='display:flex;gap:12px;flex-wrap:wrap'>" + "".join(cards) + "</div>"


def kv_blocks_line(blocks: dict) -> str:
    """The paged KV cache's blocks: in use by replies, kept for reuse, free (in tokens)."""
    n = blocks["block_tokens"]
    line = (f"{blocks['used'] * n:,} in use, {blocks['cached'] * n:,} cached for reuse, "
            f"{blocks['free'] * n:,} free of {blocks['total'] * n:,}")
    if blocks.get("reused_tokens"):
        line += f"; {blocks['reused_tokens']:,} prompt tokens reused so far"
    return html.escape(line)
