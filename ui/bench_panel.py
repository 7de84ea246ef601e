"""Benchmark panel: the loaded model on this app's decode path against plain model.generate.

Runs model_utils.bench.bench_loaded on the model that is loaded now (nothing is reloaded), with
small sizes by default so it takes seconds; the full per-mode comparison is the command line
`python -m model_utils.bench` (README, BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import asdict

import gradio as gr

from model_utils.bench import bench_loaded, chart_figure, markdown_table
from model_utils.engine import Engine

from .common import user_error

INTRO = ("Measures the loaded model: time to first token and decode tokens/s through this "
         "app's engine, next to plain `model.generate` on the same weights in the same process, "
         "greedy, on random prompt tokens. Replies wait while it runs.")


def build_bench_panel(engine: Engine) -> dict:
    c: dict = {}
    gr.Markdown(INTRO)
    with gr.Row():
        c["prompt_tokens"] = gr.Slider(8, 2048, value=32, step=8, label="Prompt tokens")
        c["new_tokens"] = gr.Slider(8, 512, value=64, step=8, label="New tokens")
        c["batches"] = gr.CheckboxGroup(["1", "4", "8"], value=["1"], label="Concurrent requests")
    c["run"] = gr.Button("Run benchmark", variant="primary", elem_id="bench-run")
    c["table"] = gr.Markdown(elem_id="bench-table")
    c["chart"] = gr.Plot(label="tokens/s")
    c["raw"] = gr.JSON(label="JSON", visible=False)

    def run(prompt_tokens, new_tokens, batches):
        if not batches:
            raise user_error("pick at least one number of concurrent requests")
        try:
            rows = bench_loaded(engine, prompt_tokens=int(prompt_tokens),
                                new_tokens=int(new_tokens),
                                batches=tuple(sorted(int(b) for b in batches)))
        except (RuntimeError, ValueError) as error:  # no model, busy switch, bad sizes
            raise user_error(str(error)) from error
        return (markdown_table(rows), chart_figure(rows),
                gr.update(value=[asdict(r) for r in rows], visible=True))

    c["run"].click(run, [c["prompt_tokens"], c["new_tokens"], c["batches"]],
                   [c["table"], c["chart"], c["raw"]], api_visibility="private",
                   concurrency_id="benchmark", concurrency_limit=1)
    return c
