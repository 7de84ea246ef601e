"""The Gradio front end. `build(engine)` returns the page; each panel has its own builder that
takes the engine and returns its components, and the API endpoints live in api.py.

The page keeps one shared piece of state, its copy of engine.status(): the model panel writes
it after Load/Unload, the memory timer writes it when another page or an API client changed the
model, and the chat panel and the header redraw from it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import gradio as gr

from model_utils.engine import Engine

from .api import register_api
from .bench_panel import build_bench_panel
from .chat_panel import build_chat_panel
from .common import AppInfo, reply_concurrency
from .memory_panel import build_memory_panel
from .model_actions import headline
from .model_panel import build_model_panel
from .openai_api import register_openai_api
from .train_panel import build_train_panel

# An extra tab: (title, builder). The builder runs inside the tab and gets the engine.
PanelBuilder = Callable[[Engine], dict]

CSS = "#chatbot .message-wrap sub { opacity: 0.7; }"  # the stats line under each reply


def build(engine: Engine, *, admin: str | None = None, info: AppInfo | None = None,
          extra_panels: Sequence[tuple[str, PanelBuilder]] = ()) -> gr.Blocks:
    """The whole page. `admin`: the only user allowed to load/unload (None: anyone).
    `info`: start-up notices (share link failure, initial load error) shown in the header.
    `extra_panels`: more tabs, e.g. [("Profiler", build_profiler_panel)]."""
    info = info or AppInfo()
    with gr.Blocks(title="Qwen chat", analytics_enabled=False) as demo:
        status = gr.State(engine.status())
        with gr.Row():
            gr.Markdown("## Qwen chat")
            header = gr.Markdown(headline(engine.status()), elem_id="headline")
        banner = gr.Markdown(info.banner(), elem_id="banner")
        with gr.Tabs():
            with gr.Tab("Chat", id="chat"):
                build_chat_panel(engine, demo=demo, status=status)
            with gr.Tab("Model", id="model"):
                build_model_panel(engine, demo=demo, status=status, admin=admin, info=info)
            with gr.Tab("Memory", id="memory"):
                build_memory_panel(engine, status=status)
            with gr.Tab("Benchmark", id="benchmark"):
                build_bench_panel(engine)
            with gr.Tab("Train", id="train"):
                build_train_panel(engine, status=status, admin=admin)
            # Further panels are passed in by the caller.
            for title, builder in extra_panels:
                with gr.Tab(title):
                    builder(engine)
        status.change(headline, status, header, api_visibility="private",
                      show_progress="hidden")
        # Read on every page load: notices written after launch (the share tunnel failed)
        # still reach the page.
        demo.load(info.banner, None, banner, api_visibility="private", show_progress="hidden")
        register_api(engine, admin=admin)
    return demo


__all__ = ["AppInfo", "PanelBuilder", "build", "register_openai_api", "reply_concurrency"]
