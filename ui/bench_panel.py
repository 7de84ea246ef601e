"""Benchmark panel: the loaded model on this app's decode path against plain model.generate.

Runs model_utils.bench.run.bench_loaded on the model that is loaded now (nothing is reloaded), with
sizes capped (bench_modes.LOADED_LIMITS) so that it takes seconds; the full per-mode comparison
is the command line `python -m model_utils.bench` (README, BENCHMARKS.md). Under --admin only
the admin may run it: checked in the handler, whatever the page shows. Chat replies go first:
the benchmark gives way to them between its steps, and its concurrent requests take at most
three quarters of the places (model_utils.bench.gate).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING

import gradio as gr

from model_utils.bench.gate import Gate
from model_utils.bench.per_mode import LOADED_LIMITS, bench_loaded
from model_utils.bench.report import chart_figure, details_table, speed_note, summary_table
from server.common import require_admin, user_error

from .bench_gate import admin_note, admin_only, whole_number

if TYPE_CHECKING:
    from model_utils.engine import Engine

INTRO = ("Measures the loaded model: time to first token and decode tokens/s through this "
         "app's engine, next to plain `model.generate` on the same weights in the same process, "
         "greedy, on random prompt tokens; and whether the two compute the same model: "
         "**Logprobs close** (where their greedy tokens part, each token is among the other's "
         "top 5 with log-probabilities within a tolerance) and **Logit error ratio** (distance "
         "of the engine's next-token distributions from an fp32 copy of the weights, over plain "
         "generate's; at most 1.1 passes). Chat replies go first: the benchmark gives way to "
         "them.")
LEGEND = ("Tokens/s per reply: decode speed of each reply; all replies: their sum when several "
          "run at once. x plain generate: all replies' tokens/s over plain generate's on the "
          "same batch. Peak GB: the most memory held during the run (CPU: the process's "
          "resident memory). \"-\" where a figure does not apply.")


def build_bench_panel(engine: Engine, *, demo: gr.Blocks | None = None,
                      admin: str | None = None) -> dict:
    c: dict = {}
    gr.Markdown(INTRO)
    with gr.Row():
        c["prompt_tokens"] = gr.Slider(8, LOADED_LIMITS["prompt_tokens"], value=32, step=8,
                                       label="Prompt tokens")
        c["new_tokens"] = gr.Slider(8, LOADED_LIMITS["new_tokens"], value=64, step=8,
                                    label="New tokens")
        choices = [str(b) for b in (1, 4, 8) if b <= LOADED_LIMITS["batch"]]
        c["batches"] = gr.CheckboxGroup(choices, value=["1"], label="Concurrent requests")
    # Under --admin the button starts disabled and the page load enables it for the admin.
    c["run"] = gr.Button("Run benchmark", variant="primary", elem_id="bench-run",
                         interactive=admin is None)
    c["note"] = gr.Markdown(admin_note(admin, None), elem_id="bench-note")
    c["table"] = gr.Markdown(elem_id="bench-table")
    with gr.Accordion("Details: every figure, the chart, JSON", open=False,
                      elem_id="bench-details"):
        c["legend"] = gr.Markdown(LEGEND)
        c["full"] = gr.Markdown(elem_id="bench-full")
        c["chart"] = gr.Plot(label="tokens/s")
        c["raw"] = gr.JSON(label="JSON")

    def run(prompt_tokens, new_tokens, batches, request: gr.Request):
        require_admin(admin, request, "run the benchmark")
        sizes = {"prompt_tokens": whole_number(prompt_tokens, "prompt tokens"),
                 "new_tokens": whole_number(new_tokens, "new tokens")}
        if not isinstance(batches, list):
            raise user_error("concurrent requests must be a list of whole numbers")
        if not batches:
            raise user_error("pick at least one number of concurrent requests")
        sizes["batches"] = tuple(sorted(whole_number(b, "concurrent requests")
                                        for b in batches))
        try:
            rows = bench_loaded(engine, **sizes)
        except (RuntimeError, ValueError) as error:  # no model, busy, bad sizes
            raise user_error(str(error)) from error
        notes = [speed_note(rows), places_note(engine, max(sizes["batches"]))]
        notes = "".join(f"\n\n{n}" for n in notes if n)
        return (summary_table(rows) + notes, details_table(rows),
                chart_figure(rows),
                [asdict(r) for r in rows])

    c["run"].click(run, [c["prompt_tokens"], c["new_tokens"], c["batches"]],
                   [c["table"], c["full"], c["chart"], c["raw"]], api_visibility="private",
                   concurrency_id="benchmark", concurrency_limit=1,
                   # The handler reads the raw values: gradio's own checks come before the
                   # admin's and answer a string or null with an error that has no text.
                   preprocess=False)
    admin_only(demo, admin, c["run"], c["note"])
    return c


def places_note(engine: Engine, largest: int) -> str:
    """What the table's concurrent runs were, where the places kept for users bounded them."""
    at_once = Gate(engine).at_once()
    if at_once is None or at_once >= largest:
        return ""
    return (f"Concurrent requests ran at most {at_once} at once: the other places "
            "(--max-batch + --max-queue) are kept for other users' replies.")
