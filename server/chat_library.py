"""Where a page's chats and presets are kept, behind one surface: in the browser without logins
(the value of a gr.BrowserState, handed in with each event and handed back changed), in the
store per user with logins (server/chat_store.py). The user is the one the login gave the
request; a library never takes a user name from the browser.
"""

from __future__ import annotations

import logging
from typing import Any

from .chat_store import ChatStore, ChatStoreError
from .chats import (
    BROWSER_LIMITS,
    ChatLimitError,
    ChatLimits,
    chat_bytes,
    check_fits,
    checked_chat,
    matches,
    newest_first,
    summary,
)
from .conversation import ConversationError
from .presets import MAX_PRESETS, checked_presets

log = logging.getLogger("server")


class BrowserLibrary:
    """The chats and presets this browser keeps: {"chats": {id: chat}} and {name: preset},
    apart (two BrowserStates), so that saving a preset and a reply written into a chat at
    the same time cannot undo each other."""

    def __init__(self, value: Any, presets: Any = None, limits: ChatLimits = BROWSER_LIMITS):
        self.limits = limits
        value = value if isinstance(value, dict) else {}
        chats = value.get("chats") if isinstance(value.get("chats"), dict) else {}
        self._chats: dict[str, dict] = {}
        for chat_id, chat in list(chats.items())[:limits.chats]:
            try:  # the browser's copy is the user's to edit: each chat checked again
                chat = checked_chat(chat)
            except ConversationError as error:
                log.warning("chat list: a chat kept in the browser is not usable (%s)", error)
                continue
            self._chats[chat["id"]] = chat
        self._presets = checked_presets(presets)

    def value(self) -> dict:
        """The chats the browser keeps from now on."""
        return {"chats": self._chats}

    def presets_value(self) -> dict:
        """The presets the browser keeps from now on."""
        return self._presets

    def summaries(self) -> list[dict]:
        return newest_first([summary(c) for c in self._chats.values()])

    def get(self, chat_id: str) -> dict | None:
        return self._chats.get(chat_id)

    def put(self, chat: dict) -> None:
        check_fits(chat, [(i, chat_bytes(c)) for i, c in self._chats.items()], self.limits)
        self._chats[chat["id"]] = chat

    def delete(self, chat_id: str) -> None:
        self._chats.pop(chat_id, None)

    def search(self, query: str) -> list[dict]:
        return newest_first([summary(c) for c in self._chats.values() if matches(c, query)])

    def presets(self) -> dict[str, dict]:
        return dict(self._presets)

    def put_preset(self, name: str, preset: dict) -> None:
        if name not in self._presets and len(self._presets) >= MAX_PRESETS:
            raise ChatLimitError(f"you have {len(self._presets)} presets, the most kept: "
                                 "delete one first")
        self._presets[name] = preset

    def delete_preset(self, name: str) -> None:
        self._presets.pop(name, None)


class StoredLibrary:
    """One logged-in user's chats and presets in the store."""

    def __init__(self, store: ChatStore, user: str):
        self.store, self.user = store, user

    def value(self) -> None:
        return None  # nothing of it is kept in the browser

    def presets_value(self) -> None:
        return None

    def summaries(self) -> list[dict]:
        return self.store.summaries(self.user)

    def get(self, chat_id: str) -> dict | None:
        chat = self.store.get(self.user, chat_id)
        if chat is None:
            return None
        try:  # written by this app, but checked as any other copy before it is shown
            return checked_chat(chat)
        except ConversationError as error:
            log.error("chat store: chat %s of %s is not usable (%s); kept as it is",
                      chat_id, self.user, error)
            raise ChatStoreError("this chat cannot be shown; it is kept as it is (the "
                                 "server's log says why)") from None

    def put(self, chat: dict) -> None:
        self.store.put(self.user, chat)

    def delete(self, chat_id: str) -> None:
        self.store.delete(self.user, chat_id)

    def search(self, query: str) -> list[dict]:
        return self.store.search(self.user, query)

    def presets(self) -> dict[str, dict]:
        return checked_presets(self.store.presets(self.user))

    def put_preset(self, name: str, preset: dict) -> None:
        self.store.put_preset(self.user, name, preset)

    def delete_preset(self, name: str) -> None:
        self.store.delete_preset(self.user, name)


def library_for(store: ChatStore | None, user: str | None, browser_value: Any,
                browser_presets: Any = None):
    """The library of this request: the store's for its login, else the browser's."""
    if store is None:
        return BrowserLibrary(browser_value, browser_presets)
    if not user:
        raise ConversationError("log in to see your chats")
    return StoredLibrary(store, user)
