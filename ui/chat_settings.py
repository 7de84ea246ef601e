"""The chat settings: one widget per generation setting, built from the settings' declarations
(model_utils/runtime/generation_settings.py), and kept in the browser next to the conversation
with the system prompt and the thinking switch; on page load both are put back (the settings
clamped to the loaded model)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import gradio as gr

from model_utils.runtime.generation_settings import SETTINGS, Setting, public
from server.conversation import ConversationError, chatbot_messages, validate_history

if TYPE_CHECKING:
    from model_utils.engine import Engine

MESSAGE_PLACEHOLDER = "Type a message; Enter sends it"
log = logging.getLogger("ui")


@dataclass(frozen=True)
class Control:
    """The chat panel's widget for a setting: a slider, or a number box (`number`). Its range
    is the page's choice, within the setting's own (which the engine checks)."""

    label: str
    value: float
    low: float
    high: float | None = None  # None: a number box without a maximum
    step: float = 1
    number: bool = False
    up_to_context: bool = False  # the slider's maximum is the loaded model's context window
    elem_id: str | None = None


# The widget of each setting the page shows (a public setting without one has no widget).
CONTROLS: dict[str, Control] = {
    "temperature": Control("temperature (0 = greedy)", 0.7, 0, 2, step=0.05),
    "top_p": Control("top_p", 1.0, 0.01, 1, step=0.01),
    "top_k": Control("top_k (0 = off)", 0, 0, 200),
    # Up to the loaded model's context: a reply can never be longer than the window.
    "max_new_tokens": Control("max_new_tokens", 4096, 1, up_to_context=True,
                              elem_id="max-new-tokens"),
    "repetition_penalty": Control("repetition_penalty (1 = off)", 1.0, 0.5, 2, step=0.01),
    "seed": Control("seed (-1 = random)", -1, -1, number=True),
}


def setting_controls(context: int, schema: tuple[Setting, ...] = SETTINGS,
                     controls: dict[str, Control] = CONTROLS) -> dict:
    """{name: widget} for every public setting that has a Control, in the schema's order.
    Call inside a gr.Blocks context. `context` bounds the widgets whose range is the context
    window (max_new_tokens: a reply can never be longer than the window)."""
    widgets = {}
    for setting in public(schema):
        spec = controls.get(setting.name)
        if spec is None:
            continue
        if spec.number:
            widgets[setting.name] = gr.Number(
                value=spec.value, precision=0 if setting.type is int else None,
                label=spec.label, minimum=spec.low, elem_id=spec.elem_id)
            continue
        high = context if spec.up_to_context else spec.high
        widgets[setting.name] = gr.Slider(spec.low, high, value=min(spec.value, high),
                                          step=spec.step, label=spec.label,
                                          elem_id=spec.elem_id)
    return widgets


def context_bounded(names, controls: dict[str, Control] = CONTROLS) -> list[str]:
    """Which of these settings' widgets range up to the loaded model's context window."""
    return [n for n in names if n in controls and controls[n].up_to_context]


def keep_settings(c: dict, engine: Engine, demo: gr.Blocks, settings_inputs: list,
                  setting_names: list[str], *, default_context: int):
    """The system prompt, the thinking switch and the settings' widgets (`settings_inputs`,
    the last ones named `setting_names`), kept in the browser next to the conversation: saved
    on every change, put back on page load. A page without saved settings starts from the
    loaded model's recommended ones (its generation_config). Returns the page load's event
    (the chat list's own load follows it)."""
    names = ["system_prompt", "thinking", *setting_names]
    bounded = set(context_bounded(setting_names))

    def save(*values):
        return dict(zip(names, values, strict=True))

    gr.on([x.change for x in settings_inputs], save, settings_inputs, c["saved_settings"],
          api_visibility="private", show_progress="hidden", trigger_mode="always_last",
          concurrency_limit=None)

    def on_page_load(conversation: list[dict], saved: dict, owner: str,
                     request: gr.Request):
        user = getattr(request, "username", None) or ""
        forget = owner != user
        if forget:  # another login's conversation and settings: not shown, not sent
            if owner:
                log.info("page load: the browser held another login's conversation; "
                         "cleared for %s", user or "-")
            conversation, saved = [], {}
        try:  # what the browser kept is the user's to edit: a broken copy starts afresh
            conversation = validate_history(conversation or [])
        except ConversationError as error:
            log.warning("page load: the saved conversation is not usable (%s)", error)
            conversation = []
        saved = {k: v for k, v in (saved or {}).items() if k in names and v is not None}
        values = {**_model_defaults(engine, setting_names), **saved}
        context = engine.status().get("context_tokens") or default_context
        notes = server_default_notes(engine.status(), setting_names)
        updates = []
        for name in names:
            if name in bounded:
                value = values.get(name)
                updates.append(gr.update(maximum=context, **(
                    {"value": min(int(value), context)} if value is not None else {})))
            elif name in notes:
                updates.append(gr.update(info=notes[name], **(
                    {"value": values[name]} if name in values else {})))
            else:
                updates.append(values[name] if name in values else gr.skip())
        # The message box stays closed: the chat list opens it once it has put the chat shown
        # back (ui/chat_list.py); a message typed before would be overwritten by it.
        kept = ([], {}, user) if forget else (gr.skip(),) * 3
        return [chatbot_messages(conversation), *kept, *updates]

    return demo.load(on_page_load, [c["conversation"], c["saved_settings"], c["owner"]],
              [c["chatbot"], c["conversation"], c["saved_settings"],
               c["owner"], *settings_inputs], api_visibility="private",
              show_progress="hidden")


def _model_defaults(engine: Engine, names: list[str]) -> dict:
    """The loaded model's recommended settings (its generation_config), or {} without one."""
    try:
        settings = engine.default_settings().as_dict()
    except Exception:  # noqa: BLE001 - no model loaded: keep the sliders as they are
        return {}
    return {k: v for k, v in settings.items() if k in names and v is not None}


SAMPLING = ("temperature", "top_p", "top_k", "repetition_penalty")


NOT_REPORTED = ("server default (the server does not say its value): left here, the "
                "server's own is used; moved, this value is sent")


def server_default_notes(status: dict, names: list[str]) -> dict[str, str]:
    """In front of a model server: each sampling widget's note, saying whether it starts at
    the server's default for the model (where the server reports one) or stands for it."""
    if not status.get("remote"):
        return {}
    reported = status.get("server_defaults") or {}
    return {name: f"server default: {reported[name]:g}" if name in reported else NOT_REPORTED
            for name in SAMPLING if name in names}


def left_to_the_server(values: dict, status: dict,
                       controls: dict[str, Control] = CONTROLS) -> dict:
    """In front of a model server: the sampling values still where their widget started
    (the server's reported default, else this page's starting value) left out of the
    request. The server then applies its model's own defaults (vLLM and SGLang: the
    generation_config it loaded), which vLLM reports nowhere: sending the page's 0.7 / 1 / 0
    overrode them for every message whose sliders nobody touched."""
    if not status.get("remote"):
        return values
    reported = status.get("server_defaults") or {}
    kept = dict(values)
    for name in SAMPLING:
        control, value = controls.get(name), kept.get(name)
        start = reported.get(name, control.value if control else None)
        if isinstance(value, (int, float)) and start is not None \
                and math.isclose(value, start, abs_tol=1e-9):
            del kept[name]
    return kept
