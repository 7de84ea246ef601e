"""The chat settings (system prompt, thinking switch, sliders) kept in the browser next to the
conversation; on page load both are put back (the settings clamped to the loaded model)."""

from __future__ import annotations

import gradio as gr

from model_utils.engine import Engine
from server.conversation import chatbot_messages
from server.replies import SETTING_NAMES


def keep_settings(c: dict, engine: Engine, demo: gr.Blocks, settings_inputs: list, *,
                  default_context: int) -> None:
    """The system prompt, the thinking switch and the sliders, kept in the browser next to
    the conversation: saved on every change, put back on page load. A page without saved
    settings starts from the loaded model's recommended ones (its generation_config)."""
    names = ["system_prompt", "thinking", *SETTING_NAMES]

    def save(*values):
        return dict(zip(names, values, strict=True))

    gr.on([x.change for x in settings_inputs], save, settings_inputs, c["saved_settings"],
          api_visibility="private", show_progress="hidden", trigger_mode="always_last",
          concurrency_limit=None)

    def on_page_load(conversation: list[dict], saved: dict):
        values = {**_model_defaults(engine), **{k: v for k, v in (saved or {}).items()
                                                 if k in names and v is not None}}
        context = engine.status().get("context_tokens") or default_context
        updates = []
        for name in names:
            if name == "max_new_tokens":
                value = values.get(name)
                updates.append(gr.update(maximum=context, **(
                    {"value": min(int(value), context)} if value is not None else {})))
            else:
                updates.append(values[name] if name in values else gr.skip())
        return [chatbot_messages(conversation or []), *updates]

    demo.load(on_page_load, [c["conversation"], c["saved_settings"]],
              [c["chatbot"], *settings_inputs], api_visibility="private", show_progress="hidden")


def _model_defaults(engine: Engine) -> dict:
    """The loaded model's recommended settings (its generation_config), or {} without one."""
    try:
        settings = engine.default_settings().as_dict()
    except Exception:  # noqa: BLE001 - no model loaded: keep the sliders as they are
        return {}
    return {k: v for k, v in settings.items() if k in SETTING_NAMES and v is not None}
