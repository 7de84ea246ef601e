"""The context budget of a message about to be sent: the conversation (its current path) plus
the message, counted as the reply's prompt would be, and the line the chat page shows for it
("1 234 / 8 192 tokens"), with a warning before the oldest turns would be left out. Shared by
the page and the /count_tokens endpoint."""

from __future__ import annotations

from typing import TYPE_CHECKING

from model_utils.chat.budget import PromptBudget, estimate_prompt

from .branches import current_path
from .conversation import engine_messages, validate_history
from .replies import make_settings

if TYPE_CHECKING:
    from model_utils.engine import Engine


def count(engine: Engine, history: list[dict] | None, message: str, settings: dict | None,
          *, system_prompt: str = "", thinking: bool = True) -> PromptBudget:
    """The budget of sending `message` after `history`. A history or settings a reply would
    refuse raise as they would then (ConversationError, InvalidParameter), and so does no
    model loaded (LoadError); a prompt that cannot be sent comes back with its error."""
    turns = current_path(validate_history(history))
    messages = [*engine_messages(turns), {"role": "user", "content": message or ""}]
    generation = make_settings(settings)
    counter = getattr(engine, "count_prompt", None)
    if counter is None:  # an engine that cannot count: an estimate, said to be one
        context = engine.status().get("context_tokens")
        return estimate_prompt(messages, generation, context_tokens=context,
                               system_prompt=system_prompt or None)
    return counter(messages, generation, system_prompt=system_prompt or None,
                   thinking=thinking)


def spaced(number: int) -> str:
    """1234567 -> "1 234 567": thousands apart, as the page writes them."""
    return f"{number:,}".replace(",", " ")


def budget_line(budget: PromptBudget) -> str:
    """The line under the message box (Markdown)."""
    if budget.error:
        return f"⚠ {budget.error}"
    about = "≈ " if budget.estimated else ""
    line = f"{about}{spaced(budget.prompt_tokens)}"
    line += f" / {spaced(budget.context_tokens)} tokens" if budget.context_tokens else " tokens"
    if budget.reply_tokens is not None and budget.context_tokens:
        line += f" · {spaced(budget.reply_tokens)} kept for the reply"
    if budget.estimated:
        line += " (an estimate: the model's tokenizer is the model server's)"
    if budget.dropped_messages:
        return (f"{line}  \n⚠ **Sending this leaves the oldest {budget.dropped_messages} "
                "message(s) out of the prompt**: the conversation and the message do not fit "
                "in the context window with the room kept for the reply.")
    if budget.near_limit:
        if budget.estimated:
            return (f"{line}  \n⚠ Close to the context window: the model server may refuse a "
                    "longer conversation.")
        return (f"{line}  \n⚠ Close to the context window: a little more and the oldest "
                "messages are left out of the prompt.")
    return line
