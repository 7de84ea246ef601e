"""Delete in the chat list: the next chat is shown (a new one after the last), and Undo
delete puts the deleted chat back, for as long as the notice offers it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import gradio as gr

from server.chats import new_chat
from server.common import user_error

if TYPE_CHECKING:
    from .chat_list import ChatList

log = logging.getLogger("ui")


def wire_delete(c: dict, chats: ChatList, cancels: list, settle) -> None:
    """Delete shows the next chat (a new one after the last); Undo delete puts it back."""
    undo_outputs = [c["chat_deleted"], c["chat_undo_delete"]]

    def delete(chat_id, browser, newest, presets, newest_presets, query,
               request: gr.Request):
        library = chats.library(request, browser, presets, newest, newest_presets)
        chat = chats.get(library, chat_id) if chat_id else None
        if chat is None:
            raise user_error("open a chat to delete first")
        library.delete(chat_id)
        rest = library.summaries()
        following = chats.get(library, rest[0]["id"]) if rest else None
        if following is None:
            following = new_chat(preset=chat["preset"], thinking=chat["thinking"])
            chats.put(library, following)
        log.info("chat list: a chat was deleted (%d left)", len(rest))
        return (*chats.show(library, following, query, notice=f"Deleted “{chat['title']}”."),
                chat, gr.update(visible=True, value=f"Undo delete of “{chat['title']}”"))

    settle(c["chat_delete"].click(
        delete, [c["chat_id"], *chats.copies, *chats.preset_copies, c["chat_search"]],
        [*chats.view, *undo_outputs], cancels=cancels, api_visibility="private",
        show_progress="hidden", **chats.in_order))

    def undo_delete(deleted, browser, newest, presets, newest_presets, query,
                    request: gr.Request):
        if not deleted:
            raise user_error("nothing to undo")
        library = chats.library(request, browser, presets, newest, newest_presets)
        chats.put(library, deleted)
        return (*chats.show(library, deleted, query), None, gr.update(visible=False))

    settle(c["chat_undo_delete"].click(
        undo_delete, [c["chat_deleted"], *chats.copies, *chats.preset_copies, c["chat_search"]],
        [*chats.view, *undo_outputs], cancels=cancels, api_visibility="private",
        show_progress="hidden", **chats.in_order))
