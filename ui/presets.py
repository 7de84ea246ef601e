"""The preset picker in the chat settings: a system prompt and the sampling settings saved under
a name (server/presets.py), picked per chat; the loaded model's recommended settings are one
of them. The chat remembers the preset picked (ui/chat_list.py keeps it with the chat)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import gradio as gr

from server.chats import ChatLimitError
from server.common import user_error
from server.conversation import ConversationError
from server.presets import MODEL_PRESET, checked_name, checked_preset, model_preset

from .chat_settings import context_bounded

if TYPE_CHECKING:
    from model_utils.engine import Engine

    from .chat_list import ChatList

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


def wire_presets(c: dict, chats: ChatList) -> None:
    """Pick, Save and Delete run on the chat list's queue, on the newest copies of the chats
    and presets (ui/chat_list.py), and each writes its pick into the chat it was made in
    (nothing else writes a chat's preset). Each leaves the view alone where a switch of chat
    the page sent right behind it ran first (ChatList.still_shown): its outputs would land on
    the chat opened (a save's name landed in that chat's picker)."""
    engine, setting_names = chats.engine, chats.setting_names
    widgets = [c[name] for name in setting_names]
    shown = [c["chat_id"], c["chat_view"], c["chat_opened"], *chats.copies,
             *chats.preset_copies]
    quiet = {"api_visibility": "private", "show_progress": "hidden", **chats.in_order}

    def written(library, chat_id: str, view: str, **fields) -> tuple:
        """(the browser's chats, this page's newest copy) after `fields` set on the chat."""
        if chats.record(library, chat_id, view, **fields):
            return chats.kept(library)
        return (gr.skip(),) * 2

    def picked(chat_id, view, opened, browser, newest, presets, newest_presets,
               chosen: gr.SelectData, request: gr.Request):
        name = chosen.value
        library = chats.library(request, browser, presets, newest, newest_presets)
        updates = preset_updates(engine, library.presets(), name, setting_names)
        fields = {"preset": name or ""}
        if isinstance(updates[0], str):
            fields["system_prompt"] = updates[0]
        if not chats.still_shown(chat_id, opened):
            updates = [gr.skip()] * len(updates)
        return *written(library, chat_id, view, **fields), *updates

    # `select`, not `input`: gradio sends a dropdown's input again whenever it loses focus,
    # which applied the chat's preset again and undid every setting changed since the pick.
    c["preset"].select(picked, shown, [*chats.copies, c["system_prompt"], *widgets], **quiet)

    def picker(library, chat_id, opened, value):
        """The picker with the presets now, showing `value` if the chat the event was sent
        from is still the one shown."""
        choices = preset_choices(library.presets())
        if chats.still_shown(chat_id, opened):
            return gr.update(choices=choices, value=value)
        return gr.update(choices=choices)

    def save(name: str, system_prompt: str, chat_id, view, opened, browser, newest, presets,
             newest_presets, request: gr.Request, *values):
        library = chats.library(request, browser, presets, newest, newest_presets)
        try:
            name = checked_name(name)
            preset = checked_preset({"system_prompt": system_prompt or "", "settings": dict(
                zip(setting_names, values, strict=True))})
            library.put_preset(name, preset)
        except (ConversationError, ChatLimitError) as error:
            raise user_error(str(error)) from None
        return (*chats.kept_presets(library), *written(library, chat_id, view, preset=name),
                picker(library, chat_id, opened, name), "")

    save_outputs = [*chats.preset_copies, *chats.copies, c["preset"], c["preset_name"]]
    for trigger in (c["preset_save"].click, c["preset_name"].submit):
        trigger(save, [c["preset_name"], c["system_prompt"], *shown, *widgets], save_outputs,
                **quiet)

    def delete(name: str | None, chat_id, view, opened, browser, newest, presets,
               newest_presets, request: gr.Request):
        if not name or name == MODEL_PRESET:
            raise user_error("pick one of your presets to delete (the model's own stays)")
        library = chats.library(request, browser, presets, newest, newest_presets)
        library.delete_preset(name)
        return (*chats.kept_presets(library), *written(library, chat_id, view, preset=""),
                picker(library, chat_id, opened, None))

    c["preset_delete"].click(delete, [c["preset"], *shown],
                             [*chats.preset_copies, *chats.copies, c["preset"]], **quiet)
