"""A chat of the chat list, and the checks and views every place that keeps chats shares (the
browser's copy without logins, the store per user with logins: server/chat_store.py).

One chat is a plain dict, so that it can live in the browser's localStorage, in one SQLite
row and in an exported file unchanged:

    {"id": "3f2a...", "title": "What are the modes?", "renamed": false,
     "created": 1764680000.0, "updated": 1764680042.5,
     "messages": [...],             # the conversation, its versions too (server/branches.py)
     "system_prompt": "", "preset": "", "thinking": true}

The title follows the first message until the user renames the chat. Pure functions: no
gradio, no engine.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

from .conversation import ConversationError, validate_history

EXPORT_ALL_FORMAT = "qwen-chat-chats"
NEW_CHAT_TITLE = "New chat"
TITLE_CHARS = 60
MAX_SYSTEM_PROMPT_CHARS = 100_000
MAX_PRESET_NAME_CHARS = 60
ID_PATTERN = re.compile(r"^[0-9a-f]{8,32}$")


class ChatLimitError(ValueError):
    """A chat or a user's chats past a limit; the message says which and what to do."""


@dataclass(frozen=True)
class ChatLimits:
    """How much one user may keep. The browser's defaults are smaller: localStorage gives a
    site 5-10 MB in all, and gr.BrowserState keeps about 2.7 bytes of it per byte of JSON."""

    chats: int = 500
    chat_bytes: int = 2 * 2**20
    total_bytes: int = 100 * 2**20


BROWSER_LIMITS = ChatLimits(chats=100, chat_bytes=1 * 2**20, total_bytes=int(1.5 * 2**20))


def new_id() -> str:
    return secrets.token_hex(8)


def new_chat(*, preset: str = "", thinking: bool = True, system_prompt: str = "",
             now: float | None = None) -> dict:
    now = time.time() if now is None else now
    return {"id": new_id(), "title": NEW_CHAT_TITLE, "renamed": False, "created": now,
            "updated": now, "messages": [], "system_prompt": system_prompt, "preset": preset,
            "thinking": thinking}


def title_from(messages: list[dict]) -> str:
    """The first user message, on one line and cut to TITLE_CHARS; "New chat" before one."""
    first = next((m["content"] for m in messages if m["role"] == "user"), "")
    text = " ".join(first.split())
    if not text:
        return NEW_CHAT_TITLE
    return text if len(text) <= TITLE_CHARS else text[:TITLE_CHARS - 1] + "…"


def with_messages(chat: dict, messages: list[dict], now: float | None = None) -> dict:
    """The chat holding `messages`; its title follows them unless renamed. A chat whose
    messages did not change keeps its place in the list (newest first by last change)."""
    if messages == chat["messages"]:
        return chat
    updated = {**chat, "messages": messages, "updated": time.time() if now is None else now}
    if not chat.get("renamed"):
        updated["title"] = title_from(messages)
    return updated


def renamed(chat: dict, title: str) -> dict:
    """An empty title gives the chat back its title from the first message."""
    text = " ".join((title or "").split())[:TITLE_CHARS]
    if not text:
        return {**chat, "title": title_from(chat["messages"]), "renamed": False}
    return {**chat, "title": text, "renamed": True}


def checked_chat(data: Any) -> dict:
    """A chat from the browser or a file, checked field by field (the messages as an API
    history); only the known fields are kept. ConversationError says what is wrong."""
    if not isinstance(data, dict):
        raise ConversationError("a chat must be an object with an id, a title and messages")
    chat_id = data.get("id")
    if not isinstance(chat_id, str) or not ID_PATTERN.match(chat_id):
        raise ConversationError("a chat's id must be 8-32 lowercase hex digits")
    messages = validate_history(data.get("messages") or [])
    title = data.get("title")
    system_prompt = data.get("system_prompt") or ""
    preset = data.get("preset") or ""
    if not isinstance(system_prompt, str) or len(system_prompt) > MAX_SYSTEM_PROMPT_CHARS:
        raise ConversationError(f"a chat's system prompt must be text of at most "
                                f"{MAX_SYSTEM_PROMPT_CHARS} characters")
    if not isinstance(preset, str) or len(preset) > MAX_PRESET_NAME_CHARS:
        raise ConversationError("a chat's preset must be a name of at most "
                                f"{MAX_PRESET_NAME_CHARS} characters")
    times = [data.get(k) for k in ("created", "updated")]
    if not all(isinstance(t, int | float) and not isinstance(t, bool) and t >= 0
               for t in times):
        times = [time.time()] * 2
    chat = {"id": chat_id, "title": "", "renamed": bool(data.get("renamed")),
            "created": float(times[0]), "updated": float(times[1]), "messages": messages,
            "system_prompt": system_prompt, "preset": preset,
            "thinking": data.get("thinking") is not False}
    return renamed(chat, title) if chat["renamed"] and isinstance(title, str) else \
        {**chat, "title": title_from(messages), "renamed": False}


def chat_json(chat: dict) -> str:
    return json.dumps(chat, ensure_ascii=False, separators=(",", ":"))


def chat_bytes(chat: dict) -> int:
    return len(chat_json(chat).encode())


def check_fits(chat: dict, others: list[tuple[str, int]], limits: ChatLimits) -> None:
    """Refuse `chat` when it, or the user's chats with it, pass the limits. `others`: (id,
    bytes) of the chats already kept (the chat's own earlier copy among them is replaced)."""
    size = chat_bytes(chat)
    if size > limits.chat_bytes:
        raise ChatLimitError(
            f"this chat is {size / 2**20:.1f} MB and a chat may hold at most "
            f"{limits.chat_bytes / 2**20:.1f} MB: start a new chat (the last change was not "
            "kept in the chat list)")
    rest = [(i, b) for i, b in others if i != chat["id"]]
    if len(rest) + 1 > limits.chats:
        raise ChatLimitError(f"you have {len(rest)} chats, the most kept: delete one first")
    total = size + sum(b for _, b in rest)
    if total > limits.total_bytes:
        raise ChatLimitError(
            f"your chats would take {total / 2**20:.1f} MB and at most "
            f"{limits.total_bytes / 2**20:.1f} MB are kept: delete or export some first")


def summary(chat: dict) -> dict:
    return {"id": chat["id"], "title": chat["title"], "updated": chat["updated"]}


def newest_first(summaries: list[dict]) -> list[dict]:
    return sorted(summaries, key=lambda s: (-s["updated"], s["id"]))


def matches(chat: dict, query: str) -> bool:
    """Whether every word of `query` is in the chat's title or one of its messages (the other
    versions of a message too), case-insensitively."""
    text = search_text(chat)
    return all(word in text for word in search_words(query))


def search_words(query: str) -> list[str]:
    return query.casefold().split()


def search_text(chat: dict) -> str:
    """What search looks in: the title and every message, case-folded (the store keeps it
    beside the chat, so that a search there reads no chat's JSON)."""
    return "\n".join([chat["title"], *_texts(chat["messages"])]).casefold()


def _texts(messages: list[dict]):
    for message in messages:
        yield message.get("content", "")
        for tail in message.get("branches", ()):
            yield from _texts(tail)


# -- export / import of every chat --------------------------------------------------------------
def export_all_json(chats: list[dict], presets: dict[str, dict] | None = None) -> str:
    return json.dumps({"format": EXPORT_ALL_FORMAT, "version": 1, "chats": chats,
                       "presets": presets or {}}, ensure_ascii=False, indent=1)


def is_export_of_all(data: Any) -> bool:
    return isinstance(data, dict) and data.get("format") == EXPORT_ALL_FORMAT


def chats_of_export(data: dict) -> list[dict]:
    """The chats of an "export all" file, each checked and given a new id (an import adds
    them beside the chats already kept, never over one)."""
    chats = data.get("chats")
    if not isinstance(chats, list):
        raise ConversationError("an export of all chats needs a 'chats' list")
    imported = []
    for i, item in enumerate(chats):
        try:
            chat = checked_chat({**item, "id": new_id()} if isinstance(item, dict) else item)
        except ConversationError as error:
            raise ConversationError(f"chat {i + 1}: {error}") from None
        imported.append(chat)
    return imported
