"""Presets: a system prompt and sampling settings saved under a name, picked per chat. They are
kept where the chats are (server/chat_library.py); the loaded model's own recommended settings
(its generation_config) are one more preset, never stored, read from the engine when picked.

    {"system_prompt": "You are terse.", "settings": {"temperature": 0.2, "top_p": 0.9}}
"""

from __future__ import annotations

from typing import Any

from model_utils.errors import InvalidParameter

from .chats import MAX_PRESET_NAME_CHARS, MAX_SYSTEM_PROMPT_CHARS
from .conversation import ConversationError
from .replies import make_settings

MODEL_PRESET = "Model's recommended"
MAX_PRESETS = 50


def checked_name(name: Any) -> str:
    text = " ".join(str(name or "").split())
    if not text:
        raise ConversationError("give the preset a name")
    if len(text) > MAX_PRESET_NAME_CHARS:
        raise ConversationError(f"a preset's name has at most {MAX_PRESET_NAME_CHARS} "
                                "characters")
    if text == MODEL_PRESET:
        raise ConversationError(f"“{MODEL_PRESET}” is the model's own: pick another name")
    return text


def checked_preset(data: Any) -> dict:
    """A preset from the page, the browser or a file; its settings checked as a request's
    (an unknown name or a value out of range is refused with the setting's name)."""
    if not isinstance(data, dict):
        raise ConversationError("a preset must be an object with system_prompt and settings")
    prompt = data.get("system_prompt") or ""
    if not isinstance(prompt, str) or len(prompt) > MAX_SYSTEM_PROMPT_CHARS:
        raise ConversationError(f"a preset's system prompt must be text of at most "
                                f"{MAX_SYSTEM_PROMPT_CHARS} characters")
    settings = data.get("settings") or {}
    if not isinstance(settings, dict):
        raise ConversationError("a preset's settings must be an object of name: value")
    settings = {k: v for k, v in settings.items() if v is not None}
    try:
        make_settings(settings)
    except InvalidParameter as error:
        raise ConversationError(f"preset setting {error}") from None
    return {"system_prompt": prompt, "settings": settings}


def checked_presets(data: Any) -> dict[str, dict]:
    """Presets kept in the browser or in a file: the good ones (a broken entry is left out:
    it could only have been written by hand)."""
    if not isinstance(data, dict):
        return {}
    kept = {}
    for name, preset in list(data.items())[:MAX_PRESETS]:
        try:
            kept[checked_name(name)] = checked_preset(preset)
        except ConversationError:
            continue
    return kept


def model_preset(engine, names: list[str]) -> dict:
    """The loaded model's recommended settings as a preset ({} of settings without a model);
    it leaves the system prompt to the chat."""
    try:
        values = engine.default_settings().as_dict()
    except Exception:  # noqa: BLE001 - no model loaded: nothing to recommend
        values = {}
    return {"system_prompt": None,
            "settings": {k: v for k, v in values.items() if k in names and v is not None}}
