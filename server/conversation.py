"""The conversation as the chat panel keeps it, and its views: engine messages, chatbot
messages, and the JSON file for export/import.

One turn is a plain dict so it can live in the browser's localStorage (gr.BrowserState) and in
an exported file unchanged:
    {"role": "user", "content": "..."}
    {"role": "assistant", "content": "answer", "reasoning": "...", "stats": "stats line"}
The chatbot is only a view of this list: the stats line and the reasoning bubble are drawn
from it, and never sent back to the model as if they were part of the answer. A message may
also carry its other versions ("branches", "branch": server/branches.py); the list itself is
always the current path, the one shown and sent.
"""

from __future__ import annotations

import json
from typing import Any

EXPORT_FORMAT = "qwen-chat-conversation"
MAX_IMPORT_BYTES = 5 * 1024 * 1024
MAX_TURNS = 2000
# All the versions of a conversation together (server/branches.py), and how deep versions may
# nest (a version holding versions of a later message, and so on): bounds the checks' work
# and their recursion.
MAX_TREE_MESSAGES = 10_000
MAX_BRANCH_DEPTH = 50
# What the browser can keep: gr.BrowserState stores the conversation encrypted and base64'd in
# localStorage (about 4/3 of its UTF-8 size, as UTF-16: 2 bytes a character), and a browser
# gives a site 5-10 MB in all. A conversation past this was accepted, then lost at the next
# reload (QuotaExceededError), so an import past it is refused.
MAX_KEPT_BYTES = 2 * 1024 * 1024


class ConversationError(ValueError):
    """A file or a history that is not a conversation; the message says what is wrong."""


# -- views ------------------------------------------------------------------------------------
def engine_messages(conversation: list[dict]) -> list[dict]:
    """Turns -> what engine.chat takes. Earlier reasoning goes as reasoning_content: the
    model's chat template decides whether to show it (Qwen3's drops it from old turns)."""
    out = []
    for turn in conversation:
        message = {"role": turn["role"], "content": turn.get("content", "")}
        if turn["role"] == "assistant" and turn.get("reasoning"):
            message["reasoning_content"] = turn["reasoning"]
        out.append(message)
    return out


def chatbot_messages(conversation: list[dict], pending: dict | None = None) -> list[dict]:
    """Turns (plus the reply being streamed, if any) -> gr.Chatbot messages."""
    out: list[dict] = []
    for turn in conversation:
        if turn["role"] == "user":
            out.append({"role": "user", "content": turn["content"]})
        else:
            out.extend(_assistant_view(turn, streaming=False))
    if pending is not None:
        out.extend(_assistant_view(pending, streaming=True))
    return out


def turn_of_view(conversation: list[dict], view_index: int) -> int | None:
    """Which turn of the conversation the chatbot's message number `view_index` shows (an
    assistant turn is drawn as one or two messages); None past the end."""
    drawn = 0
    for i, turn in enumerate(conversation):
        drawn += 1 if turn["role"] == "user" else len(_assistant_view(turn, streaming=False))
        if view_index < drawn:
            return i
    return None


def _assistant_view(turn: dict, *, streaming: bool) -> list[dict]:
    messages = []
    reasoning, answer = turn.get("reasoning", ""), turn.get("content", "")
    if reasoning:
        # A message with metadata.title is drawn as a collapsible "thought" bubble; "pending"
        # keeps it open with a spinner while the model is still thinking.
        thinking_now = streaming and not answer
        messages.append({"role": "assistant", "content": reasoning,
                         "metadata": {"title": "Reasoning",
                                      "status": "pending" if thinking_now else "done"}})
    if streaming:
        text = (answer + " ▌") if answer or not reasoning else ""
    else:
        text = answer or "*(empty reply)*"
    if turn.get("stats") and not streaming:
        text += f"\n\n<sub>{turn['stats']}</sub>"
    if text:
        messages.append({"role": "assistant", "content": text})
    return messages


# -- editing ----------------------------------------------------------------------------------
def without_last_reply(conversation: list[dict]) -> tuple[list[dict], str | None]:
    """For Regenerate: (the conversation before the last user message, that message)."""
    turns = list(conversation)
    while turns and turns[-1]["role"] == "assistant":
        turns.pop()
    if not turns:
        return list(conversation), None
    return turns[:-1], turns[-1]["content"]


def without_last_turn(conversation: list[dict]) -> tuple[list[dict], str]:
    """For Undo: drop the last user message and its reply; give the message back for editing."""
    before, message = without_last_reply(conversation)
    return (before, message) if message is not None else (list(conversation), "")


# -- export / import --------------------------------------------------------------------------
def export_json(conversation: list[dict], system_prompt: str = "") -> str:
    return json.dumps({"format": EXPORT_FORMAT, "version": 1, "system_prompt": system_prompt,
                       "messages": conversation}, ensure_ascii=False, indent=2)


def import_json(text: str) -> tuple[list[dict], str | None]:
    """Exported file (or a bare list of {role, content}) -> (turns, system prompt or None)."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConversationError(f"not a JSON file: {error}") from None
    except RecursionError:
        raise ConversationError("the JSON is nested too deeply to read") from None
    except ValueError:  # json refuses integers of more than 4300 digits
        raise ConversationError("the JSON holds a number too long to read (over 4300 "
                                "digits)") from None
    system_prompt = None
    if isinstance(data, dict):
        if not isinstance(data.get("messages"), list):
            raise ConversationError("expected an exported conversation (an object with a "
                                    "'messages' list) or a list of {role, content}")
        if isinstance(data.get("system_prompt"), str):
            system_prompt = data["system_prompt"]
        data = data["messages"]
    turns = validate_history(data)
    # A leading system message (OpenAI style) becomes the system prompt.
    if turns and turns[0]["role"] == "system":
        system_prompt = turns.pop(0)["content"]
    kept = len(json.dumps(turns, ensure_ascii=False).encode()) + \
        len((system_prompt or "").encode())
    if kept > MAX_KEPT_BYTES:
        raise ConversationError(
            f"the conversation is {kept / 2**20:.1f} MB and the browser keeps at most "
            f"{MAX_KEPT_BYTES // 2**20} MB of it (it would be lost at the next reload): "
            "import a shorter part of it")
    return turns, system_prompt


def validate_history(history: Any) -> list[dict]:
    """Check a history from a file or an API call and keep only the known fields (the other
    versions of a message too: server/branches.py; the model is sent the current path)."""
    if history is None:
        return []
    if not isinstance(history, list):
        raise ConversationError("history must be a list of {role, content} objects")
    if len(history) > MAX_TURNS:
        raise ConversationError(f"history has {len(history)} messages; at most {MAX_TURNS}")
    counted = [0]
    turns = _checked(history, "", 0, counted)
    if counted[0] > MAX_TREE_MESSAGES:
        raise ConversationError(f"the conversation has {counted[0]} messages in all its "
                                f"versions; at most {MAX_TREE_MESSAGES}")
    return turns


def _checked(items: list, where: str, depth: int, counted: list[int]) -> list[dict]:
    turns = []
    for i, item in enumerate(items):
        at = f"{where}message {i}"
        if not isinstance(item, dict) or item.get("role") not in ("system", "user", "assistant"):
            raise ConversationError(f"{at} needs a role of system, user or assistant")
        content = item.get("content", "")
        if not isinstance(content, str):
            raise ConversationError(f"{at}: content must be a string")
        if item["role"] == "system" and (i != 0 or where):
            raise ConversationError(f"{at}: a system message may only come first")
        turn = {"role": item["role"], "content": content}
        for key in ("reasoning", "stats"):
            if item["role"] == "assistant" and isinstance(item.get(key), str) and item[key]:
                turn[key] = item[key]
        counted[0] += 1
        if counted[0] > MAX_TREE_MESSAGES:
            raise ConversationError(f"the conversation has more than {MAX_TREE_MESSAGES} "
                                    "messages in all its versions")
        if item.get("branches"):
            turn.update(_checked_versions(item, at, depth, counted))
        turns.append(turn)
    return turns


def _checked_versions(item: dict, at: str, depth: int, counted: list[int]) -> dict:
    """The other versions of a message: {"branches": [[message, ...], ...], "branch": n}."""
    others, chosen = item["branches"], item.get("branch")
    if depth >= MAX_BRANCH_DEPTH:
        raise ConversationError(f"{at}: versions nested more than {MAX_BRANCH_DEPTH} deep")
    if not isinstance(others, list) or not all(isinstance(t, list) and t for t in others):
        raise ConversationError(f"{at}: branches must be a list of non-empty message lists")
    if isinstance(chosen, bool) or not isinstance(chosen, int) or \
            not 0 <= chosen <= len(others):
        raise ConversationError(f"{at}: branch must be a number from 0 to {len(others)}")
    tails = []
    for j, tail in enumerate(others):
        where = f"{at}, version {j + (j >= chosen) + 1}, "
        if not isinstance(tail[0], dict) or tail[0].get("role") != item["role"]:
            raise ConversationError(f"{where}message 0: a version of a {item['role']} "
                                    f"message must be a {item['role']} message")
        if "branches" in tail[0]:
            raise ConversationError(f"{where}message 0: its versions belong to the message "
                                    "shown")
        tails.append(_checked(tail, where, depth + 1, counted))
    return {"branches": tails, "branch": chosen}
