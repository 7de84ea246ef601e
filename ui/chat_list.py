"""The chat list beside the conversation: New chat, the chats newest first (a click opens one),
search, rename, delete with undo. Each chat keeps its conversation (with its versions), its
system prompt, its preset and its Thinking switch.

The conversation shown stays the chat panel's `conversation` (in the browser, as before);
every change of it, of the system prompt or of the switch is written into the chat shown, in
the library of this page (server/chat_library.py: the browser's without logins, the store's
for the logged-in user with them). The preset is written only by the handlers that set it
(ui/presets.py: pick, save, delete), into the chat they were sent from: a change event sent
while a save was under way carried the preset from before it, and written after the save,
it took the chat's new preset back.

Each write names the chat its values were read with, and is written there or nowhere:
- Which chat is shown is held by the page itself (`chat_id`, a hidden field sent with each
  event); `chat_view` names the chat the widgets hold, and follows `chat_id` only once every
  widget of its view has landed. Gradio applies an event's outputs one by one, and the preset
  picker (its choices, then its value) lands after the others: a change event fired in between
  read the new chat's id with the chat before's preset, or with none after a reload. A write
  is kept only where the two ids agree.
- Without logins the chats travel with each event as the browser's copy, read when the event
  was sent: writes queued one after another each built on the copy from before the others
  had run, and the last to land undid the rest. The newest copy this page was handed stays
  on the server with the page's session (`chat_newest`, a gr.State, read when the handler
  runs), and every handler that changes the chats runs on one queue, one at a time. So do
  the presets (`presets_newest`), and the preset handlers (ui/presets.py) run on the same queue.
- That queue takes events in the order they reach the server, and two the page sent together
  may reach it in either order (a Save preset sent a millisecond before a click on another
  chat was run after the switch). `chat_opened` (a gr.State: set as the server runs the
  events) names the chat the last switch opened; a pick or a save run after a switch the page
  sent behind it is written into its own chat, and its view outputs, which would land on the
  chat opened since, are left out (ChatList.still_shown).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import gradio as gr

from server.chat_library import library_for
from server.chat_store import ChatStoreError
from server.chats import ChatLimitError, new_chat, renamed, with_messages
from server.common import user_error
from server.conversation import ConversationError, chatbot_messages, validate_history

from .chat_delete import wire_delete
from .chat_settings import MESSAGE_PLACEHOLDER
from .presets import preset_choices, preset_updates

if TYPE_CHECKING:
    from model_utils.engine import Engine
    from server.chat_store import ChatStore

CHAT_STORAGE_KEYS = ("qwen-chat-library", "qwen-chat-current", "qwen-chat-presets")
REFUSED = (ChatLimitError, ChatStoreError, ConversationError)
# The handlers that read or change the chats or presets: one at a time, in the order they reach
# the server, each on the newest copy the one before left (a switch of chat reads a write
# queued before it).
IN_ORDER = {"concurrency_id": "chat-write", "concurrency_limit": 1}
log = logging.getLogger("ui")


def build_chat_list() -> dict:
    """The list's components; call inside the layout, in the column beside the chatbot."""
    c: dict = {}
    c["chat_new"] = gr.Button("New chat", variant="primary", size="sm", elem_id="chat-new")
    c["chat_search"] = gr.Textbox(show_label=False, placeholder="Search chats",
                                  elem_id="chat-search", container=False)
    c["chat_list"] = gr.Radio(choices=[], show_label=False, elem_id="chat-list",
                              container=False)
    c["chat_title"] = gr.Textbox(label="Title of this chat", elem_id="chat-title",
                                 placeholder="from the first message")
    with gr.Row():
        c["chat_rename"] = gr.Button("Rename", size="sm", elem_id="chat-rename")
        c["chat_delete"] = gr.Button("Delete", size="sm", elem_id="chat-delete")
    c["chat_undo_delete"] = gr.Button("Undo delete", size="sm", visible=False,
                                      elem_id="chat-undo-delete")
    c["chat_list_notice"] = gr.Markdown("", elem_id="chat-list-notice")
    # Without logins the chats and presets live here; with logins this stays empty.
    c["chat_library"] = gr.BrowserState({}, storage_key=CHAT_STORAGE_KEYS[0])
    c["chat_presets"] = gr.BrowserState({}, storage_key=CHAT_STORAGE_KEYS[2])
    c["chat_remembered"] = gr.BrowserState("", storage_key=CHAT_STORAGE_KEYS[1])
    c["chat_id"] = gr.Textbox("", visible="hidden", elem_id="chat-id")
    c["chat_view"] = gr.Textbox("", visible="hidden", elem_id="chat-view")
    c["chat_newest"] = gr.State(None)  # the newest copy of the browser's chats, this page's
    c["chat_opened"] = gr.State("")  # the chat the last switch the server ran opened
    c["presets_newest"] = gr.State(None)  # and of its presets
    c["chat_deleted"] = gr.State(None)  # the chat Undo delete puts back
    return c


class ChatList:
    """The handlers' shared parts: which library, and the view of a chat."""

    in_order = IN_ORDER  # the queue of every handler that reads or changes chats or presets

    def __init__(self, c: dict, engine: Engine, store: ChatStore | None,
                 setting_names: list[str], idle=None):
        self.c, self.engine, self.store, self.setting_names = c, engine, store, setting_names
        # Send, Stop and Regenerate as after a reply: opening another chat stops the one
        # streaming, and its last update (which would have said so) never comes.
        self.idle = idle or (lambda: (gr.skip(),) * 3)
        # What a chat keeps of the page, and the chats' two copies (the browser's, this
        # page's newest): the inputs and outputs of most handlers.
        self.current = [c["conversation"], c["system_prompt"], c["thinking"], c["preset"]]
        self.copies = [c["chat_library"], c["chat_newest"]]
        self.preset_copies = [c["chat_presets"], c["presets_newest"]]
        self.view = [c["send"], c["stop"], c["regenerate"], c["chatbot"], c["conversation"],
                     c["notice"], c["system_prompt"], c["thinking"], c["preset"],
                     *(c[n] for n in setting_names), c["chat_list"], c["chat_title"],
                     c["chat_id"], c["chat_remembered"], *self.copies, c["chat_list_notice"],
                     c["message"], c["chat_opened"]]

    def library(self, request: gr.Request | None, value, presets=None, newest=None,
                newest_presets=None):
        """`value`, `presets`: the browser's copies of its chats and presets, as the event
        brought them; `newest`, `newest_presets`: the copies this page was handed last (None
        before any), which the browser may not hold yet."""
        try:
            return library_for(self.store, getattr(request, "username", None),
                               value if newest is None else newest,
                               presets if newest_presets is None else newest_presets)
        except ConversationError as error:
            raise user_error(str(error)) from None

    def choices(self, library, query: str | None) -> list[tuple[str, str]]:
        query = (query or "").strip()
        found = library.search(query) if query else library.summaries()
        return [(s["title"], s["id"]) for s in found]

    def list_update(self, library, query: str | None, shown: str | None):
        choices = self.choices(library, query)
        value = shown if any(v == shown for _, v in choices) else None
        return gr.update(choices=choices, value=value)

    def kept(self, library) -> tuple:
        """(the browser's copy, this page's newest copy): the chats from now on."""
        value = library.value()
        return (gr.skip(),) * 2 if value is None else (value, value)

    def kept_presets(self, library) -> tuple:
        """(the browser's presets, this page's newest copy of them): the presets from now on."""
        value = library.presets_value()
        return (gr.skip(),) * 2 if value is None else (value, value)

    def show(self, library, chat: dict, query: str | None, notice: str = "", *,
             changed: bool = True) -> list:
        """The view of `chat`: conversation, its settings, the list with it picked, and the
        message box open. The browser's chats are handed back only when this event `changed`
        them: a copy handed back unchanged could undo a write another event made meanwhile."""
        presets = library.presets()
        preset = chat["preset"] if chat["preset"] in preset_choices(presets) else None
        prompt_and_settings = preset_updates(self.engine, presets, preset, self.setting_names)
        return [*self.idle(), chatbot_messages(chat["messages"]),
                chat["messages"], "",
                chat["system_prompt"], chat["thinking"],
                gr.update(choices=preset_choices(presets), value=preset),
                *prompt_and_settings[1:], self.list_update(library, query, chat["id"]),
                chat["title"], chat["id"], chat["id"],
                *(self.kept(library) if changed else (gr.skip(),) * 2), notice,
                gr.update(interactive=True, placeholder=MESSAGE_PLACEHOLDER), chat["id"]]

    @staticmethod
    def still_shown(chat_id: str, opened: str | None) -> bool:
        """Whether the chat an event was sent from (`chat_id`) is still the one shown, as the
        server runs it: no switch run since opened another (`opened`: chat_opened)."""
        return not opened or opened == chat_id

    def put(self, library, chat: dict) -> None:
        try:
            library.put(chat)
        except REFUSED as error:
            raise user_error(str(error)) from None

    def get(self, library, chat_id: str) -> dict | None:
        try:
            return library.get(chat_id)
        except ChatStoreError as error:
            raise user_error(str(error)) from None

    def record(self, library, chat_id: str, view: str, **fields) -> bool:
        """Set `fields` on the chat shown, where the widgets hold its whole view (as for every
        write of what the page shows). Whether the chat changed."""
        if not chat_id or view != chat_id:
            return False
        chat = self.get(library, chat_id)
        if chat is None or {**chat, **fields} == chat:
            return False
        self.put(library, {**chat, **fields})
        return True


def wire_chat_list(c: dict, engine: Engine, store: ChatStore | None, *, loaded,
                   cancels: list, setting_names: list[str], idle) -> ChatList:
    """`loaded`: the page load's event that puts the conversation and settings back (the
    list's own load follows it); `cancels`: the reply events a switch of chat stops, and
    `idle()` the (Send, Stop, Regenerate) updates after it. Returns the handlers' shared
    parts (export and import use them too)."""
    chats = ChatList(c, engine, store, setting_names, idle)
    settle = _wire_writes(c, chats)
    _wire_page_load(c, chats, loaded, settle)
    _wire_switches(c, chats, cancels, settle)
    wire_delete(c, chats, cancels, settle)
    _wire_rename_and_search(c, chats)
    return chats


def _wire_writes(c: dict, chats: ChatList):
    """Every change of what the page shows is written into the chat shown. Returns
    settle(event), for each event that shows a chat."""

    def keep_shown(chat_id, view, opened, conversation, system_prompt, thinking, preset,
                   browser, newest, query, notice, request: gr.Request):
        """Write what the page shows into the chat shown: on the page's state, never a
        broken copy (the chat panel refuses to send those, and so does this). Not the preset,
        which pick, save and delete write, except into a chat another tab deleted, which
        this write brings back whole."""
        nothing = (gr.skip(),) * 5
        if not chat_id or view != chat_id:
            # No chat put back yet, or another chat's view still landing: these values may
            # be partly the chat shown before.
            return nothing
        library = chats.library(request, browser, newest=newest)
        try:
            before = library.get(chat_id)
            messages = validate_history(conversation or [])
        except REFUSED:
            return nothing
        if before is None:
            if not chats.still_shown(chat_id, opened):
                # Deleted on this page after the write was sent (each event is a request of
                # its own, and one sent first can arrive second): it stays deleted.
                return nothing
            # Deleted in another tab: this one's writing brings it back.
            before = {**new_chat(preset=preset or ""), "id": chat_id}
        chat = {**with_messages(before, messages), "system_prompt": system_prompt or "",
                "thinking": bool(thinking)}
        if chat == before:
            return nothing
        listed = chats.choices(library, query)
        try:
            library.put(chat)
        except REFUSED as error:
            return *(gr.skip(),) * 4, f"⚠ {error}"
        title = chat["title"] if chat["title"] != before["title"] else gr.skip()
        # The list is redrawn only when its titles or order changed: a redraw picks the chat
        # shown again, and undid a click on another chat made while it landed.
        update = chats.list_update(library, query, chat_id)
        # A write that worked takes back a write's warning only: a notice such as "Deleted
        # …" stays (the write that follows a delete landed on it and wiped it).
        cleared = "" if (notice or "").startswith("⚠") else gr.skip()
        return (*chats.kept(library), gr.skip() if update["choices"] == listed else update,
                title, cleared)

    inputs = [c["chat_id"], c["chat_view"], c["chat_opened"], *chats.current, *chats.copies,
              c["chat_search"], c["chat_list_notice"]]
    outputs = [*chats.copies, c["chat_list"], c["chat_title"], c["chat_list_notice"]]
    # The conversation's content, not its object: see ui/content_change.py. Not the preset
    # picker's: its value may land on a chat opened since the pick or save that set it.
    changes = [c["conversation_changed"].change, c["system_prompt"].change,
               c["thinking"].change]
    gr.on(changes, keep_shown, inputs, outputs,
          # Every change is written, in order: with "always_last" a change still waiting
          # when the next one came was dropped, even one of the chat shown before a switch.
          api_visibility="private", show_progress="hidden", trigger_mode="multiple",
          **IN_ORDER)

    def settle(event) -> None:
        """After `event` showed a chat: the widgets hold that chat's view once all of its
        outputs have landed, which is when gradio runs the step after it. Then what they
        show is written once: a change made while the view landed was not (nor the page
        load's newer conversation)."""
        event.then(None, [c["chat_id"]], [c["chat_view"]], js="(id) => id",
                   api_visibility="private", show_progress="hidden"
                   ).then(keep_shown, inputs, outputs, api_visibility="private",
                          show_progress="hidden", **IN_ORDER)

    return settle


def _remembered(library, remembered: str) -> tuple[dict | None, str]:
    """(the chat a page load puts back: the one shown last, else the newest; a notice)."""
    ids = [s["id"] for s in library.summaries()]
    chosen = remembered if remembered in ids else (ids[0] if ids else None)
    try:
        return (library.get(chosen) if chosen else None), ""
    except ChatStoreError as error:  # kept as it is; a new chat is shown instead
        return None, f"⚠ {error}"


def _wire_page_load(c: dict, chats: ChatList, loaded, settle) -> None:
    def page_load(conversation, system_prompt, thinking, preset, browser, presets, remembered,
                  query, request: gr.Request):
        library = chats.library(request, browser, presets)
        chat, notice = _remembered(library, remembered)
        changed = False
        if chat is None:  # the first visit: the conversation the page had becomes a chat
            try:
                messages = validate_history(conversation or [])
            except ConversationError:
                messages = []
            chat = with_messages(new_chat(preset=preset or "", thinking=bool(thinking),
                                          system_prompt=system_prompt or ""), messages)
            try:  # refused (a limit): shown all the same, so that the page opens
                library.put(chat)
                changed = True
            except REFUSED as error:
                notice = f"⚠ {error}"
        elif chats.store is None and chat["id"] == remembered:
            # Without logins the conversation in the browser is written first (also by a
            # reply cut short by a reload): it is the newer copy of this chat (written into
            # it once the view has landed).
            try:
                chat = with_messages(chat, validate_history(conversation or []))
            except ConversationError:
                pass
        return chats.show(library, chat, query, notice, changed=changed)

    # The browser's copy only: this page has handed none back yet.
    settle(loaded.then(page_load, [*chats.current, c["chat_library"], c["chat_presets"],
                                   c["chat_remembered"], c["chat_search"]],
                       chats.view, api_visibility="private", show_progress="hidden",
                       **IN_ORDER))


def _wire_switches(c: dict, chats: ChatList, cancels: list, settle) -> None:
    """A click on a chat of the list opens it; New chat starts one."""

    def open_chat(chat_id, browser, newest, presets, newest_presets, query,
                  request: gr.Request):
        library = chats.library(request, browser, presets, newest, newest_presets)
        chat = chats.get(library, chat_id) if chat_id else None
        if chat is None:
            raise user_error("that chat is gone (deleted in another tab?)")
        return chats.show(library, chat, query, changed=False)

    settle(c["chat_list"].input(
        open_chat, [c["chat_list"], *chats.copies, *chats.preset_copies, c["chat_search"]],
        chats.view, cancels=cancels, api_visibility="private", show_progress="hidden",
        **IN_ORDER))

    def start_new(chat_id, conversation, system_prompt, thinking, preset, browser, newest,
                  presets, newest_presets, query, request: gr.Request):
        library = chats.library(request, browser, presets, newest, newest_presets)
        shown = chats.get(library, chat_id) if chat_id else None
        if shown is not None and not shown["messages"] and not conversation:
            # The chat shown is a new one already.
            return chats.show(library, shown, query, changed=False)
        chat = new_chat(preset=preset or "", thinking=bool(thinking),
                        system_prompt=system_prompt or "")
        chats.put(library, chat)
        return chats.show(library, chat, query)

    settle(c["chat_new"].click(
        start_new, [c["chat_id"], *chats.current, *chats.copies, *chats.preset_copies,
                    c["chat_search"]],
        chats.view, cancels=cancels, api_visibility="private", show_progress="hidden",
        **IN_ORDER))


def _wire_rename_and_search(c: dict, chats: ChatList) -> None:
    def search(query, chat_id, browser, newest, request: gr.Request):
        return chats.list_update(chats.library(request, browser, newest=newest), query,
                                 chat_id)

    # .change, not .input: the list follows whatever sets the box (a paste, an autofill).
    # In order: a write queued before the search lists the chats for the words it was sent
    # with, and landing after the search it would put the whole list back.
    gr.on([c["chat_search"].change, c["chat_search"].submit], search,
          [c["chat_search"], c["chat_id"], *chats.copies], c["chat_list"],
          api_visibility="private", show_progress="hidden", trigger_mode="always_last",
          **IN_ORDER)

    def rename(chat_id, title, browser, newest, query, request: gr.Request):
        library = chats.library(request, browser, newest=newest)
        chat = chats.get(library, chat_id) if chat_id else None
        if chat is None:
            raise user_error("open a chat to rename first")
        chat = renamed(chat, title)
        chats.put(library, chat)
        return (*chats.kept(library), chats.list_update(library, query, chat_id),
                chat["title"])

    outputs = [*chats.copies, c["chat_list"], c["chat_title"]]
    for trigger in (c["chat_rename"].click, c["chat_title"].submit):
        trigger(rename, [c["chat_id"], c["chat_title"], *chats.copies, c["chat_search"]],
                outputs, api_visibility="private", show_progress="hidden", **IN_ORDER)
