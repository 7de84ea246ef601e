"""The Model, Memory and Benchmark tabs when the app is the front end of a model server
(--backend): what is true there is the server's address, its models and its health; modes,
placements and GPU memory are the server's business."""

from __future__ import annotations

import html
import time
from dataclasses import asdict

import gradio as gr

from model_utils.backends.bench import bench_remote, markdown_table
from server.common import require_admin, user_error

from .bench_gate import admin_note, admin_only, whole_number

REFRESH_S = 2.0
THE_SERVERS_BUSINESS = (
    "Modes, placements, batching and GPU memory are the model server's business: they are "
    "chosen where it runs (for vLLM: `vllm serve MODEL --tensor-parallel-size N ...`), and "
    "this app cannot load, unload or switch models there.")


def server_markdown(status: dict) -> str:
    health = status.get("health") or {}
    if health.get("ok"):
        state = (f"**up** · /models answered in {health.get('latency_ms')} ms, "
                 f"{_ago(health.get('checked_at'))}")
    elif health.get("checked_at"):
        state = (f"**down** since {_clock(health.get('since'))}: {health.get('error')} "
                 "(checked again every few seconds)")
    else:
        state = "not checked yet"
    models = status.get("models") or []
    listed = ", ".join(f"**{m}** (replies here)" if m == status.get("model") else m
                       for m in models) or "none known yet"
    lines = [f"**Model server:** `{status.get('backend_url')}` · {state}",
             f"**Models it serves:** {listed}"]
    if health.get("ok") and health.get("error"):
        lines.append(f"**Note:** {health['error']}")
    if status.get("context_tokens"):
        lines.append(f"context window: {status['context_tokens']} tokens (as the server says)")
    if status.get("refused_extensions"):
        lines.append("not sent (the server refused them): "
                     + ", ".join(status["refused_extensions"]))
    lines.append(THE_SERVERS_BUSINESS)
    return "\n\n".join(lines)


def _ago(when: float | None) -> str:
    return f"{max(0.0, time.time() - when):.0f} s ago" if when else ""


def _clock(when: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(when)) if when else "?"


def _what_changed(status: dict) -> tuple:
    """The parts of the status the rest of the page follows (not each check's latency)."""
    return (status.get("loaded"), status.get("model"), tuple(status.get("models") or ()),
            (status.get("health") or {}).get("ok"), status.get("context_tokens"))


def build_remote_model_panel(engine, *, status: gr.State) -> dict:
    c = {"server": gr.Markdown(server_markdown(engine.status()), elem_id="remote-server"),
         "timer": gr.Timer(REFRESH_S)}

    def refresh(current: dict):
        now = engine.status()
        changed = now if _what_changed(now) != _what_changed(current or {}) else gr.skip()
        return server_markdown(now), changed

    c["timer"].tick(refresh, [status], [c["server"], status], api_visibility="private",
                    show_progress="hidden", concurrency_limit=None)
    return c


def memory_markdown(engine) -> str:
    snapshot = engine.memory_snapshot()
    return (f"{html.escape(snapshot.note)}\n\nThis host: RAM used {snapshot.cpu_used_gb:.2f} / "
            f"{snapshot.cpu_total_gb:.2f} GB · this process (RSS) "
            f"{snapshot.process_rss_gb:.2f} GB")


def build_remote_memory_panel(engine) -> dict:
    c = {"memory": gr.Markdown(memory_markdown(engine), elem_id="remote-memory"),
         "timer": gr.Timer(REFRESH_S * 5)}
    c["timer"].tick(lambda: memory_markdown(engine), None, c["memory"], api_visibility="private",
                    show_progress="hidden", concurrency_limit=None)
    return c


def build_remote_bench_panel(engine, *, demo: gr.Blocks | None = None,
                             admin: str | None = None) -> dict:
    """Under --admin only the admin may run it (its streams take places every user's replies
    need): checked in the handler, whatever the page shows, as the local engine's bench."""
    c: dict = {}
    gr.Markdown("Time to first token and tokens/s through the model server, measured here "
                "(what a user of this page sees): greedy, thinking off, one stream and "
                "several at once. Other users' replies share the server meanwhile. The same "
                "from a shell: `python -m model_utils.backends.bench --backend URL`.")
    with gr.Row():
        c["new_tokens"] = gr.Slider(8, 1024, value=64, step=8, label="New tokens")
        c["streams"] = gr.CheckboxGroup(["1", "4", "8", "32"], value=["1", "8"],
                                        label="Concurrent streams")
    # Under --admin the button starts disabled and the page load enables it for the admin.
    c["run"] = gr.Button("Run benchmark", variant="primary", elem_id="remote-bench-run",
                         interactive=admin is None)
    c["note"] = gr.Markdown(admin_note(admin, None), elem_id="remote-bench-note")
    c["table"] = gr.Markdown(elem_id="remote-bench-table")
    c["raw"] = gr.JSON(label="JSON", visible=False)

    def run(new_tokens, streams, request: gr.Request):
        require_admin(admin, request, "run the benchmark")
        tokens = whole_number(new_tokens, "new tokens")
        if not isinstance(streams, list):
            raise user_error("concurrent streams must be a list of whole numbers")
        if not streams:
            raise user_error("pick at least one number of concurrent streams")
        counts = tuple(sorted(whole_number(s, "concurrent streams") for s in streams))
        try:
            rows = bench_remote(engine, streams=counts, new_tokens=tokens,
                                at_once=engine.bench_places())
        except (RuntimeError, ValueError) as error:  # the server down, bad sizes
            raise user_error(str(error)) from error
        return markdown_table(rows), gr.update(value=[asdict(r) for r in rows], visible=True)

    c["run"].click(run, [c["new_tokens"], c["streams"]], [c["table"], c["raw"]],
                   api_visibility="private", concurrency_id="benchmark", concurrency_limit=1,
                   # The handler reads the raw values: gradio's own checks would come before
                   # the admin's and answer with an error that has no text.
                   preprocess=False)
    admin_only(demo, admin, c["run"], c["note"])
    return c
