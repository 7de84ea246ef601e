"""Export and import, of the chat shown or of every chat: Export JSON writes the conversation
shown (with its versions and system prompt), Export all chats every chat of the list and the
presets; Import JSON takes either file: a conversation goes into the chat shown, an export of
all chats is added beside the chats already kept (each as a new chat)."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path

import gradio as gr

from server.chats import chats_of_export, export_all_json, is_export_of_all
from server.common import user_error
from server.conversation import (
    MAX_IMPORT_BYTES,
    ConversationError,
    chatbot_messages,
    export_json,
    import_json,
)
from server.presets import checked_presets

from .chat_list import IN_ORDER, REFUSED, ChatList
from .presets import preset_choices


def build_transfer() -> dict:
    """Call inside the Export / import accordion."""
    c: dict = {}
    with gr.Row():
        c["export"] = gr.Button("Export JSON", size="sm", elem_id="export")
        c["export_all"] = gr.Button("Export all chats", size="sm", elem_id="export-all")
    c["import"] = gr.UploadButton("Import JSON", file_types=[".json"], size="sm",
                                  elem_id="import")
    c["export_file"] = gr.File(label="Exported", visible=False, interactive=False)
    return c


def wire_transfer(c: dict, chats: ChatList, export_dir: Path) -> None:
    def export(conversation: list[dict], system_prompt: str):
        path = export_dir / time.strftime("conversation-%Y%m%d-%H%M%S.json")
        path.write_text(export_json(conversation or [], system_prompt or ""), encoding="utf-8")
        return gr.update(value=str(path), visible=True)

    c["export"].click(export, [c["conversation"], c["system_prompt"]], [c["export_file"]],
                      api_visibility="private")

    def export_all(browser, newest, presets, newest_presets, request: gr.Request):
        library = chats.library(request, browser, presets, newest, newest_presets)
        everything = [chats.get(library, s["id"]) for s in library.summaries()]
        # The folder is served to every page: a name nobody else can guess keeps one user's
        # export from another.
        path = export_dir / time.strftime(f"chats-%Y%m%d-%H%M%S-{secrets.token_hex(8)}.json")
        path.write_text(export_all_json([x for x in everything if x], library.presets()),
                        encoding="utf-8")
        return gr.update(value=str(path), visible=True)

    # In order: a change made just before the click is written, and exported, first.
    c["export_all"].click(export_all, [*chats.copies, *chats.preset_copies],
                          [c["export_file"]], api_visibility="private", **IN_ORDER)

    def import_(path: str | None, browser, newest, presets, newest_presets, query, shown: str,
                request: gr.Request):
        if not path:
            raise user_error("no file was uploaded")
        file = Path(path)
        if file.stat().st_size > MAX_IMPORT_BYTES:
            raise user_error(f"the file is larger than {MAX_IMPORT_BYTES // 2**20} MB")
        try:
            text = file.read_text(encoding="utf-8")
            data = json.loads(text) if text.lstrip().startswith("{") else None
        except (UnicodeDecodeError, ValueError, RecursionError):
            data = None  # import_json says what is wrong with it
        if is_export_of_all(data):
            library = chats.library(request, browser, presets, newest, newest_presets)
            return import_all(data, file.name, library, query, shown)
        try:
            turns, system_prompt = import_json(text)
        except (ConversationError, UnicodeDecodeError) as error:
            raise user_error(f"cannot import {file.name}: {error}") from error
        prompt = gr.skip() if system_prompt is None else system_prompt
        return chatbot_messages(turns), turns, prompt, *(gr.skip(),) * 7

    def import_all(data: dict, name: str, library, query, shown: str):
        imported, added = [], 0
        try:
            imported = chats_of_export(data)
            for chat in imported:
                library.put(chat)
                added += 1
            for preset_name, preset in checked_presets(data.get("presets")).items():
                if preset_name not in library.presets():
                    library.put_preset(preset_name, preset)
        except REFUSED as error:
            # The browser's copy is handed back only when the import succeeds.
            kept_now = added if library.value() is None else 0
            raise user_error(f"cannot import {name}: {error} ({kept_now} of "
                             f"{len(imported)} chats were added)") from None
        return (gr.skip(), gr.skip(), gr.skip(), *chats.kept(library),
                *chats.kept_presets(library),
                gr.update(choices=preset_choices(library.presets())),
                chats.list_update(library, query, shown),
                f"Imported {len(imported)} chats from {name}.")

    c["import"].upload(import_, [c["import"], *chats.copies, *chats.preset_copies,
                                 c["chat_search"], c["chat_id"]],
                       [c["chatbot"], c["conversation"], c["system_prompt"], *chats.copies,
                        *chats.preset_copies, c["preset"], c["chat_list"],
                        c["chat_list_notice"]],
                       api_visibility="private", **IN_ORDER)
