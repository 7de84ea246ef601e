"""The preset picker in the chat settings: a system prompt and the sampling settings saved under
a name (server/presets.py), picked per chat; the loaded model's recommended settings are one
of them. The chat remembers the preset picked (ui/chat_list.py keeps it with the chat)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import gradio as gr

from server.chat_library import library_for
from server.chats import ChatLimitError
from server.common import user_error
from server.conversation import ConversationError
from server.presets import MODEL_PRESET, checked_name, checked_preset, model_preset

from .chat_settings import context_bounded

if TYPE_CHECKING:
    from model_utils.engine import Engine
    from server.chat_store import ChatStore

DEFAULT_CONTEXT = 8192


def build_presets() -> dict:
    """The picker and its Save / Delete; call inside the settings accordion."""
    c: dict = {}
    c["preset"] = gr.Dropdown(label="Preset", choices=[MODEL_PRESET], value=None,
                              elem_id="preset", interactive=True)
    with gr.Row(equal_height=True):
        c["preset_name"] = gr.Textbox(show_label=False, placeholder="name for these settings",
                                      elem_id="preset-name", scale=3, container=False)
        c["preset_save"] = gr.Button("Save preset", size="sm", elem_id="preset-save", scale=1)
    c["preset_delete"] = gr.Button("Delete this preset", size="sm", elem_id="preset-delete")
    return c


def preset_choices(presets: dict[str, dict]) -> list[str]:
    return [MODEL_PRESET, *sorted(presets)]


def preset_updates(engine: Engine, presets: dict[str, dict], name: str | None,
                   setting_names: list[str]) -> list:
    """(system prompt, *setting widgets) for the preset `name`: gr.skip() where it says
    nothing (no such preset, the model's preset for the system prompt)."""
    if name == MODEL_PRESET:
        preset = model_preset(engine, setting_names)
    else:
        preset = presets.get(name or "")
    if preset is None:
        return [gr.skip()] * (1 + len(setting_names))
    context = engine.status().get("context_tokens") or DEFAULT_CONTEXT
    bounded = set(context_bounded(setting_names))
    updates = [gr.skip() if preset["system_prompt"] is None else preset["system_prompt"]]
    for name_ in setting_names:
        value = preset["settings"].get(name_)
        if value is None:
            updates.append(gr.skip())
        else:
            updates.append(min(value, context) if name_ in bounded else value)
    return updates


def wire_presets(c: dict, engine: Engine, store: ChatStore | None, *,
                 setting_names: list[str]) -> None:
    widgets = [c[name] for name in setting_names]

    def library(request: gr.Request, presets):
        try:
            return library_for(store, getattr(request, "username", None), None, presets)
        except ConversationError as error:
            raise user_error(str(error)) from None

    def picked(name: str | None, kept, request: gr.Request):
        return preset_updates(engine, library(request, kept).presets(), name, setting_names)

    c["preset"].input(picked, [c["preset"], c["chat_presets"]],
                      [c["system_prompt"], *widgets], api_visibility="private",
                      show_progress="hidden")

    def save(name: str, system_prompt: str, kept, request: gr.Request, *values):
        chats = library(request, kept)
        try:
            name = checked_name(name)
            preset = checked_preset({"system_prompt": system_prompt or "", "settings": dict(
                zip(setting_names, values, strict=True))})
            chats.put_preset(name, preset)
        except (ConversationError, ChatLimitError) as error:
            raise user_error(str(error)) from None
        value = chats.presets_value()
        return (gr.skip() if value is None else value,
                gr.update(choices=preset_choices(chats.presets()), value=name), "")

    c["preset_save"].click(save, [c["preset_name"], c["system_prompt"], c["chat_presets"],
                                  *widgets],
                           [c["chat_presets"], c["preset"], c["preset_name"]],
                           api_visibility="private", show_progress="hidden")
    c["preset_name"].submit(save, [c["preset_name"], c["system_prompt"], c["chat_presets"],
                                   *widgets],
                            [c["chat_presets"], c["preset"], c["preset_name"]],
                            api_visibility="private", show_progress="hidden")

    def delete(name: str | None, kept, request: gr.Request):
        if not name or name == MODEL_PRESET:
            raise user_error("pick one of your presets to delete (the model's own stays)")
        chats = library(request, kept)
        chats.delete_preset(name)
        value = chats.presets_value()
        return (gr.skip() if value is None else value,
                gr.update(choices=preset_choices(chats.presets()), value=None))

    c["preset_delete"].click(delete, [c["preset"], c["chat_presets"]],
                             [c["chat_presets"], c["preset"]], api_visibility="private",
                             show_progress="hidden")
