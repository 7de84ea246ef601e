"""The line under the message box that says how much of the context window the conversation
plus the message being typed take ("1 234 / 8 192 tokens"), and warns before the oldest turns
would be left out (server/context_budget.py counts and words it).

Counted once the text stops changing, not on every key: each change of the message box's (and
the system prompt's) text only (re)starts a timer in the browser, and when it runs out it
clicks a hidden button, whose event counts on the server. The change event, not the input
event: gradio's Textbox fires `input` for typed characters only, so a paste, a cut, Backspace
or Delete, or text filled in by a script went uncounted. Also counted on page load and when the
conversation, the thinking switch, max_new_tokens or the model changes (a streaming reply
changes the conversation once a second: a count of a small, bounded cost)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import gradio as gr

from model_utils.errors import InvalidParameter, LoadError
from server.context_budget import budget_line, count
from server.conversation import ConversationError

if TYPE_CHECKING:
    from model_utils.engine import Engine

TYPING_PAUSE_MS = 400  # how long the text must stay unchanged before it is counted
TRIGGER_ID = "context-budget-count"
log = logging.getLogger("ui")

# The browser side of the debounce: each change of the text pushes the count back.
_AFTER_TYPING = f"""() => {{
    clearTimeout(window.qwenBudgetTimer);
    window.qwenBudgetTimer = setTimeout(
        () => document.getElementById({TRIGGER_ID!r})?.click(), {TYPING_PAUSE_MS});
}}"""


def build_budget_line() -> dict:
    """The line and its hidden trigger; call inside the layout, near the message box."""
    return {"budget": gr.Markdown("", elem_id="context-budget"),
            "budget_count": gr.Button("count", visible="hidden", elem_id=TRIGGER_ID)}


def wire_context_budget(c: dict, engine: Engine, *, demo: gr.Blocks, status: gr.State,
                        settings_inputs: list, setting_names: list[str]) -> None:
    """`settings_inputs`: system prompt, thinking switch, then the settings named
    `setting_names`."""

    def measure(message: str, conversation: list[dict], system_prompt: str, thinking: bool,
                *setting_values):
        values = dict(zip(setting_names, setting_values, strict=True))
        try:
            budget = count(engine, conversation or [], message or "", values,
                           system_prompt=system_prompt or "", thinking=bool(thinking))
        except LoadError:
            return ""  # no model: nothing to count against
        except (ConversationError, InvalidParameter) as error:
            return f"⚠ {error}"  # what Send would say too
        except Exception:  # noqa: BLE001 - a view only: logged, the page goes on
            log.exception("counting the context budget failed")
            return ""
        return budget_line(budget)

    for box in (c["message"], c["system_prompt"]):
        # js only: nothing reaches the server until the timer runs out.
        box.change(None, None, None, js=_AFTER_TYPING)
    bounded = [c[name] for name in setting_names if name == "max_new_tokens"]
    gr.on([c["budget_count"].click, c["conversation_changed"].change, c["thinking"].change,
           status.change, demo.load, *[x.change for x in bounded]],
          measure, [c["message"], c["conversation"], *settings_inputs], c["budget"],
          api_visibility="private", show_progress="hidden", trigger_mode="always_last",
          concurrency_id="count", concurrency_limit=4)
