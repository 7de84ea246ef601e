"""The Gradio front end. `build(engine)` returns the page; each panel has its own builder that
takes the engine and returns its components, and the API endpoints live in api.py.

The page keeps one shared piece of state, its copy of engine.status(): the model panel writes
it after Load/Unload, and a page-level timer writes it when another page or an API client
changed the model (it polls engine.status_version(), a counter, and fetches the status only
when that moved). The header, the model panel and the chat panel redraw from it, whichever
tab is open.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import gradio as gr

from model_utils.backends.remote import RemoteEngine
from server.api import register_api
from server.common import AppInfo, reply_concurrency
from server.guards import request_guard
from server.model_actions import headline
from server.openai_api import register_openai_api
from server.queue_gone import queue_stream_watch

from .chat_list import CHAT_STORAGE_KEYS
from .chat_panel import STORAGE_KEYS, STORAGE_OWNER_KEY, build_chat_panel
from .remote_panel import (
    build_remote_bench_panel,
    build_remote_memory_panel,
    build_remote_model_panel,
)

if TYPE_CHECKING:
    from model_utils.engine import Engine
    from server.chat_store import ChatStore

# An extra tab: (title, builder). The builder runs inside the tab and gets the engine.
PanelBuilder = Callable[["Engine"], dict]

APP_NAME = "Qwen chat"
# HTML (gradio's login page renders it as such, not as Markdown).
LOGIN_MESSAGE = (f"<p><strong style='font-size:1.5em'>{APP_NAME}</strong></p>"
                 "<p>Log in to chat with the models served here.</p>")
STATUS_POLL_S = 1.0  # a change made elsewhere shows on every page within about this long

CSS = ("#chatbot .message-wrap sub { opacity: 0.7; }"  # the stats line under each reply
       # Table cells wrap between words only: narrow columns broke "Mode" into "Mod e".
       " #bench-table th, #bench-table td, #bench-full th, #bench-full td"
       " { word-break: normal; overflow-wrap: normal; hyphens: none; }"
       # The bundled font's bold face draws "B" as a small capital ("Peak Gʙ", "2.53 Gʙ"):
       # the bold figures and table headers in the system's sans-serif.
       " #bench-table th, #bench-full th, #memory-cards b"
       " { font-family: ui-sans-serif, system-ui, sans-serif; }")


def build(engine: Engine, *, admin: str | None = None, info: AppInfo | None = None,
          extra_panels: Sequence[tuple[str, PanelBuilder]] = (),
          logout: bool = False, chat_store: ChatStore | None = None) -> gr.Blocks:
    """The whole page. `admin`: the only user allowed to load/unload (None: anyone).
    `info`: start-up notices (share link failure, initial load error) shown in the header.
    `extra_panels`: more tabs, e.g. [("Profiler", build_profiler_panel)].
    `logout`: logins are on, so the header offers a Log out link (gradio's /logout).
    `chat_store`: with logins, where each user's chats and presets are kept (None: each
    browser keeps its own)."""
    info = info or AppInfo()
    remote = isinstance(engine, RemoteEngine)  # a model server's: its own tabs (remote_panel)
    if not remote:
        # The local engine's tabs (they import torch), only where a model runs in this process:
        # a front end for a model server starts without torch.
        from .bench_panel import build_bench_panel
        from .memory_panel import build_memory_panel
        from .model_panel import build_model_panel
        from .train_panel import build_train_panel
    with gr.Blocks(title=APP_NAME, analytics_enabled=False) as demo:
        status = gr.State(engine.status())
        with gr.Row(equal_height=True):
            gr.Markdown(f"## {APP_NAME}")
            header = gr.Markdown(headline(engine.status()), elem_id="headline")
            # Relative, so it also works under a proxy's root path; /logout clears the cookie
            # and sends the browser back to the login page.
            logout_button = gr.Button("Log out", link="logout", size="sm", scale=0,
                                      min_width=90, elem_id="logout", visible=logout)
        banner = gr.Markdown(info.banner(), elem_id="banner")
        with gr.Tabs():
            with gr.Tab("Chat", id="chat"):
                build_chat_panel(engine, demo=demo, status=status, chat_store=chat_store)
            with gr.Tab("Model", id="model"):
                if remote:
                    build_remote_model_panel(engine, status=status)
                else:
                    build_model_panel(engine, demo=demo, status=status, admin=admin, info=info)
            with gr.Tab("Memory", id="memory"):
                if remote:
                    build_remote_memory_panel(engine)
                else:
                    build_memory_panel(engine)
            with gr.Tab("Benchmark", id="benchmark"):
                if remote:
                    build_remote_bench_panel(engine, demo=demo, admin=admin)
                else:
                    build_bench_panel(engine, demo=demo, admin=admin)
            with gr.Tab("Train", id="train") as train_tab:
                if remote:
                    gr.Markdown("Training runs on this machine's own engine; with --backend "
                                "the models are the model server's.")
                else:
                    build_train_panel(engine, status=status, admin=admin, tab=train_tab)
            # Further panels are passed in by the caller.
            for title, builder in extra_panels:
                with gr.Tab(title):
                    builder(engine)
        # The conversation and settings kept in this browser go with the login (the next
        # page load checks their owner as well, for a login that ends without this click).
        keys = [*STORAGE_KEYS, STORAGE_OWNER_KEY, *CHAT_STORAGE_KEYS]
        logout_button.click(None, js=f"() => {{ for (const key of {keys!r}) "
                            "localStorage.removeItem(key); }")
        status.change(headline, status, header, api_visibility="private",
                      show_progress="hidden")
        _follow_engine(engine, status)
        # Read on every page load: notices written after launch (the share tunnel failed)
        # still reach the page. And on every change of the model, which can end the start-up
        # failure's notice (AppInfo.follow): open pages follow the engine's status.
        def banner_now(status_now: dict | None = None) -> str:
            if info.startup_error:  # only then is the status needed
                info.follow(status_now if status_now is not None else engine.status())
            return info.banner()

        demo.load(banner_now, None, banner, api_visibility="private", show_progress="hidden")
        status.change(banner_now, status, banner, api_visibility="private",
                      show_progress="hidden")
        register_api(engine, admin=admin)
    return demo


def _follow_engine(engine: Engine, status: gr.State) -> None:
    """Keep this page's status in step with the engine, whichever tab is open: a tick reads
    the engine's status version (an int), and only when it moved the status itself, so
    the panels redraw on a change and not on every tick."""
    seen = gr.State(-1)  # -1: the first tick fetches the status a freshly opened page needs

    def follow(version_seen: int):
        version = engine.status_version()  # read first: a change after it shows next tick
        if version == version_seen:
            return gr.skip(), gr.skip()
        return version, {k: v for k, v in engine.status().items() if k != "unloaded"}

    gr.Timer(STATUS_POLL_S).tick(follow, seen, [seen, status], api_visibility="private",
                                 show_progress="hidden", concurrency_limit=None)


__all__ = ["APP_NAME", "LOGIN_MESSAGE", "AppInfo", "PanelBuilder", "build",
           "queue_stream_watch", "register_openai_api", "reply_concurrency", "request_guard"]
