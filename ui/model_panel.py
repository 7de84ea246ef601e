"""The model panel: pick a model, a mode and a placement, see whether it fits, Load / Unload
with a progress bar, and the status of what is loaded (device map, footprint, load time)."""

from __future__ import annotations

import contextvars
import threading
import time
from typing import TYPE_CHECKING

import gradio as gr

from model_utils.loading.demo_model import DEMO_LABEL
from model_utils.loading.mode_figures import modes_compared_markdown
from model_utils.loading.modes import dropdown_choices, dropdown_info
from model_utils.loading.placement import STRATEGIES, available_placements
from server import model_actions as actions
from server.common import STARTUP_FAILED, AppInfo
from server.errors import client_path, models_dir_of, shows_full_paths

if TYPE_CHECKING:
    from model_utils.engine import Engine

SPLIT_COST = ("Splitting a model over GPUs makes every token wait on each GPU in turn: "
              "measured 5x slower decoding (8.4 vs 41.3 tok/s) than one GPU for a model that "
              "fits on one. `auto` keeps it on one GPU whenever it fits.")


def build_model_panel(engine: Engine, *, demo: gr.Blocks, status: gr.State,
                      admin: str | None = None, info: AppInfo | None = None) -> dict:
    c: dict = {}
    picks = current_picks(engine)
    snapshot = engine.memory_snapshot()
    placements = available_placements()
    with gr.Row(equal_height=False):
        with gr.Column(scale=1):
            c["model"] = gr.Dropdown(actions.model_picks(engine.registry), label="Model", value=picks["model"],
                                     elem_id="model")
            c["model_path"] = gr.Textbox(label="…or a folder path / Hugging Face hub id "
                                         "(overrides the list when filled)",
                                         value=picks["model_path"], elem_id="model-path",
                                         placeholder="/models/Qwen2.5-7B-Instruct or Qwen/Qwen3-8B")
            c["mode"] = gr.Dropdown(dropdown_choices(), label="Mode", info=dropdown_info(),
                                    value=picks["mode"], elem_id="mode")
            c["placement"] = gr.Dropdown(placements, label="Placement", value=picks["placement"],
                                         elem_id="placement", info=_placement_note(placements))
            # One cap per visible GPU and one for the CPU; 0 = no cap.
            c["caps"] = {}
            for gpu in snapshot.gpus:
                c["caps"][f"cuda:{gpu.index}"] = gr.Slider(
                    0, round(gpu.total_gb, 1), value=0, step=0.5,
                    label=f"cuda:{gpu.index} {gpu.name}: max GB (0 = no cap)")
            c["caps"]["cpu"] = gr.Slider(0, round(snapshot.cpu_total_gb, 1), value=0, step=0.5,
                                         label="CPU RAM: max GB (0 = no cap)")
            with gr.Accordion("Advanced", open=False):
                c["offload_folder"] = gr.Textbox(label="Offload folder (disk offload for what "
                                                 "fits nowhere; strategies only)")
                c["compute_dtype"] = gr.Dropdown(list(actions.COMPUTE_DTYPES), value="bf16",
                                                 label="Compute dtype (4-bit modes)")
                # A textbox, not a gr.Number: a Number shows 0 when empty, which reads as
                # "a context of 0" under a label that says empty means the model's own.
                c["context_tokens"] = gr.Textbox(label="Context tokens",
                                                 placeholder="empty = the model's own (or the "
                                                             "most that fits)",
                                                 elem_id="context-tokens")
            with gr.Accordion("Modes compared", open=False):
                gr.Markdown(modes_compared_markdown(), elem_id="modes-compared")
        with gr.Column(scale=1):
            c["estimate"] = gr.Markdown(elem_id="estimate")
            with gr.Row():
                c["load"] = gr.Button("Load", variant="primary", elem_id="load")
                c["unload"] = gr.Button("Unload", elem_id="unload")
            c["admin_note"] = gr.Markdown(
                f"Only the admin user (**{admin}**) may load or unload models." if admin else "",
                elem_id="admin-note")
            # The load's progress bar is drawn here, in a box of its own, not over the
            # status and the estimate.
            c["message"] = gr.Markdown(info.startup_message() if info else "",
                                       elem_id="model-message", min_height=64)
            c["status"] = gr.Markdown(actions.status_markdown(engine.status()),
                                      elem_id="model-status")
    _wire(c, engine, demo, status, admin, info or AppInfo())
    return c


def _wire(c: dict, engine: Engine, demo: gr.Blocks, status: gr.State,
          admin: str | None, info: AppInfo) -> None:
    caps = c["caps"]
    picks = {c["model"], c["model_path"], c["mode"], c["placement"], c["offload_folder"],
             c["compute_dtype"], c["context_tokens"], *caps.values()}

    def request_from(values: dict):
        return actions.make_request(
            model=values[c["model_path"]]
            or actions.model_named(engine.registry, values[c["model"]]), mode=values[c["mode"]],
            placement=values[c["placement"]],
            max_memory_gb={device: values[slider] for device, slider in caps.items()},
            offload_folder=values[c["offload_folder"]],
            compute_dtype=values[c["compute_dtype"]],
            context_tokens=context_from_text(values[c["context_tokens"]]))

    def estimate(values: dict, request: gr.Request = None) -> str:
        user = getattr(request, "username", None)  # None: called below, or no logins
        try:
            return actions.estimate_text(engine, request_from(values),
                                         full_paths=shows_full_paths(admin, user))
        except gr.Error as error:
            return f"**Cannot estimate:** {error.message}"

    # Inputs given as a set: the handler gets {component: value}, whatever the GPU count.
    gr.on([x.change for x in picks], estimate, picks, c["estimate"],
          api_visibility="private", show_progress="hidden", trigger_mode="always_last")

    def load(values: dict, request: gr.Request, progress=gr.Progress()):  # noqa: B008 (gradio API)
        clicked = time.perf_counter()
        try:
            result = actions.load(engine, request_from(values), admin=admin, who=request,
                                  progress=progress_from_any_thread(progress))
            message = actions.loaded_message(result, time.perf_counter() - clicked)
        except gr.Error as error:
            # Shown twice on purpose: a toast now, and a line that stays next to the status.
            gr.Warning(error.message)
            result, message = engine.status(), f"**Failed:** {error.message}"
        return message, actions.status_markdown(result), result, estimate(values, request)

    def unload(request: gr.Request):
        try:
            result = actions.unload(engine, admin=admin, who=request)
            message = actions.unload_message(result)
        except gr.Error as error:
            gr.Warning(error.message)
            result, message = engine.status(), f"**Failed:** {error.message}"
        return message, actions.status_markdown(result), _plain(result)

    outputs = [c["message"], c["status"], status]
    c["load"].click(load, picks, [*outputs, c["estimate"]], concurrency_id="model",
                    concurrency_limit=1, api_visibility="private",
                    show_progress_on=[c["message"]])
    c["unload"].click(unload, None, outputs, concurrency_id="model", concurrency_limit=1,
                      api_visibility="private", show_progress_on=[c["message"]])

    def for_this_user(request: gr.Request | None):
        """Load and Unload as this user may use them: a guest (logged in, not the admin)
        sees them disabled with the reason. The handlers check again: this is only a view."""
        user = getattr(request, "username", None)
        if admin is None or user == admin:
            return gr.skip(), gr.skip(), gr.skip()
        note = (f"Load and Unload are disabled: only the admin user (**{admin}**) may change "
                f"the model, and you are {'not logged in' if user is None else f'**{user}**'}.")
        return gr.update(interactive=False), gr.update(interactive=False), note

    demo.load(for_this_user, None, [c["load"], c["unload"], c["admin_note"]],
              api_visibility="private", show_progress="hidden")

    def on_page_load(values: dict, request: gr.Request):
        # The picks start at what is loaded now, so "pick a mode, press Load" switches the
        # model that is serving, even one loaded from a typed path or by another page.
        current = current_picks(engine)
        drawn_path = values[c["model_path"]]
        values = {**values, c["model"]: current["model"], c["mode"]: current["mode"],
                  c["model_path"]: current["model_path"], c["placement"]: current["placement"]}
        typed_path = current["model_path"]
        if typed_path and not shows_full_paths(admin, getattr(request, "username", None)):
            typed_path = client_path(typed_path, models_dir_of(engine))  # a guest's view
        info.follow(current["status"])
        # Left alone when it already reads so: a path typed while this answer was on its way
        # (a busy server) is not wiped.
        path = gr.skip() if typed_path == drawn_path else typed_path
        return (actions.status_markdown(current["status"]), current["status"],
                estimate(values, request),
                gr.update(choices=current["choices"], value=current["model"]),
                path, current["mode"], current["placement"], info.startup_message())

    demo.load(on_page_load, picks,
              [c["status"], status, c["estimate"], c["model"], c["model_path"], c["mode"],
               c["placement"], c["message"]], api_visibility="private", show_progress="hidden")

    def on_status(status_now: dict, message: str):
        """Any change of the loaded model (this page, another page, an API call) redraws the
        status; a load that ends the start-up failure takes its message away too (the
        message of a load or unload made here stays)."""
        info.follow(status_now)
        shown = message or ""
        ended = shown.startswith(STARTUP_FAILED) and not info.startup_error
        return actions.status_markdown(status_now), "" if ended else gr.skip()

    status.change(on_status, [status, c["message"]], [c["status"], c["message"]],
                  api_visibility="private", show_progress="hidden")


def context_from_text(text: str | None) -> int | str | None:
    """The Context tokens box -> make_request's context_tokens: empty -> None (the model's),
    digits -> int; anything else goes on as typed, so make_request names it in its error."""
    text = (text or "").strip()
    if not text:
        return None
    return int(text) if text.isdigit() else text


def _plain(status: dict) -> dict:
    """The status without the one-off unload report (the page state compares equal again)."""
    return {k: v for k, v in status.items() if k != "unloaded"}


def progress_from_any_thread(progress: gr.Progress):
    """engine.load's progress callback, usable from the engine's decode worker too.

    gr.Progress finds its event through context variables, which exist only in the handler's
    thread; the engine reports the compile warm-up from its worker thread, where a plain call
    would be dropped. So each update runs in a copy of the handler's context (one at a time:
    a context cannot be entered by two threads at once).
    """
    context = contextvars.copy_context()
    lock = threading.Lock()

    def update(fraction: float, message: str) -> None:
        with lock:
            context.run(progress, fraction, desc=message)

    return update


def current_picks(engine: Engine) -> dict:
    """What the pickers should show for the model that is loaded now."""
    current = engine.status()
    listed = engine.registry.choices()
    choices = actions.model_picks(engine.registry)  # labels: no server path in the page
    model, model_path = (listed[0][0] if listed else DEMO_LABEL), ""
    if current.get("loaded"):
        label_of = {name: label for label, name in reversed(listed)}
        if current.get("is_demo"):
            model = DEMO_LABEL
        elif current["model"] in {label for label, _ in listed}:
            model = current["model"]  # folders and cached hub ids carry the same label
        elif current.get("path") in label_of:
            model = label_of[current["path"]]
        else:
            model_path = current.get("path", "")
    placements = available_placements()
    target = (current.get("placement") or "").split(" ", 1)[0].rstrip(",")
    return {"status": current, "choices": choices, "model": model, "model_path": model_path,
            "mode": current.get("mode") or "bf16",
            "placement": target if target in placements else actions.default_placement()}


def _placement_note(placements: list[str]) -> str:
    if len(placements) == 1:
        gpu_only = ", ".join(["cuda:N", *STRATEGIES])
        return f"GPU placements ({gpu_only}) are not offered: this machine has no CUDA GPU."
    return SPLIT_COST

