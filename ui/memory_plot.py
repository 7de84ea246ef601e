"""The memory plot as inline SVG: one line per series over the last minutes, the time axis in
clock times (HH:MM:SS, the server's clock, which is the clock of the memory it shows).

Drawn here rather than with gr.LinePlot: gradio's plot writes a Vega-Lite v5 spec that its own
bundled Vega-Lite 6 warns about in the browser console on every redraw, and its default time
axis labels a few seconds of data as ".800 .800 .800". An SVG of a few hundred points is a few
kilobytes, needs no script, and follows the page's light/dark colours through CSS variables.
"""

from __future__ import annotations

import html
import math
import time

from model_utils.memory import MemorySnapshot

WIDTH, HEIGHT = 900, 260
LEFT, RIGHT, TOP, BOTTOM = 56, 12, 12, 44  # room for the GB labels and the clock times
COLORS = ("#2563eb", "#ea580c", "#16a34a", "#9333ea", "#dc2626", "#0891b2", "#ca8a04",
          "#db2777")
TICK_CHOICES_S = (10, 15, 30, 60, 120, 300, 600, 1800, 3600)


def series(points: list[MemorySnapshot]) -> dict[str, list[tuple[float, float]]]:
    """Snapshots -> {series name: [(unix time, GB), ...]}, in a stable order."""
    out: dict[str, list[tuple[float, float]]] = {"CPU RAM used": [], "process RSS": []}
    for p in points:
        out["CPU RAM used"].append((p.time, p.cpu_used_gb))
        out["process RSS"].append((p.time, p.process_rss_gb))
        for gpu in p.gpus:
            if gpu.used_gb is not None:
                out.setdefault(f"cuda:{gpu.index} used", []).append((p.time, gpu.used_gb))
            out.setdefault(f"cuda:{gpu.index} allocated", []).append((p.time, gpu.allocated_gb))
    return {name: values for name, values in out.items() if values}


def nice_step(span: float, ticks: int = 5) -> float:
    """A 1/2/5 x 10^k step that cuts `span` into about `ticks` parts."""
    raw = max(span, 1e-9) / ticks
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def memory_svg(points: list[MemorySnapshot], *, window_s: float) -> str:
    """The plot of `points` over the `window_s` seconds before the newest one."""
    if not points:
        return "<p><i>No memory samples yet.</i></p>"
    end = points[-1].time
    start = end - window_s
    lines = series([p for p in points if p.time >= start])
    top = max((gb for values in lines.values() for _, gb in values), default=1.0) * 1.1 or 1.0
    step = nice_step(top)
    top = math.ceil(top / step) * step
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(t: float) -> float:
        return LEFT + (t - start) / window_s * plot_w

    def y(gb: float) -> float:
        return TOP + plot_h - gb / top * plot_h

    parts = [(f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" width="100%" role="img" '
              f'aria-label="memory over the last {window_s / 60:.0f} minutes" '
              'style="font-size:12px;fill:var(--body-text-color)">')]
    grid = 'style="stroke:var(--border-color-primary);stroke-width:1"'
    k = 0
    while k * step <= top + 1e-9:  # GB gridlines
        gb = k * step
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(gb):.1f}" '
                     f'y2="{y(gb):.1f}" {grid}/>')
        parts.append(f'<text x="{LEFT - 6}" y="{y(gb) + 4:.1f}" text-anchor="end">'
                     f'{gb:g}</text>')
        k += 1
    tick = next((s for s in TICK_CHOICES_S if window_s / s <= 8), TICK_CHOICES_S[-1])
    t = math.ceil(start / tick) * tick  # on round clock times: 12:03:00, 12:04:00, ...
    while t <= end:
        parts.append(f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{TOP}" '
                     f'y2="{TOP + plot_h}" {grid}/>')
        parts.append(f'<text class="mem-time" x="{x(t):.1f}" y="{TOP + plot_h + 16}" '
                     f'text-anchor="middle">{clock(t)}</text>')
        t += tick
    zone = html.escape(time.strftime("%Z") or "local")
    parts.append(f'<text x="{LEFT + plot_w / 2:.1f}" y="{HEIGHT - 6}" text-anchor="middle">'
                 f'time (server clock, {zone}) · GB</text>')
    legend = []
    for i, (name, values) in enumerate(lines.items()):
        color = COLORS[i % len(COLORS)]
        coords = " ".join(f"{x(t):.1f},{y(gb):.1f}" for t, gb in values)
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" '
                     f'points="{coords}"><title>{html.escape(name)}</title></polyline>')
        legend.append(f'<span style="margin-right:14px"><span style="display:inline-block;'
                      f'width:12px;height:3px;background:{color};vertical-align:middle">'
                      f'</span> {html.escape(name)}: {values[-1][1]:.2f} GB</span>')
    parts.append("</svg>")
    return (f"<div class='mem-plot'><div style='font-weight:600'>Memory, last "
            f"{window_s / 60:.0f} minutes (sampled every few seconds, until {clock(end)})"
            f"</div>{''.join(parts)}<div style='font-size:12px'>{''.join(legend)}</div></div>")
