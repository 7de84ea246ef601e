"""Messages -> the prompt the model receives, through the tokenizer's own chat template.

The template is the model's contract: Qwen3's decides where <think> goes, how an earlier
assistant turn's reasoning is dropped, and what enable_thinking=False inserts. So this module
never formats ChatML itself; it normalises messages, calls apply_chat_template, and trims the
oldest turns when the conversation outgrows the context window.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ChatInputError(ValueError):
    """Input the chat cannot turn into a prompt; the message says what to change."""


@dataclass(frozen=True)
class PreparedPrompt:
    text: str
    input_ids: list[int]
    dropped_messages: int  # oldest non-system messages left out to fit the context

    @property
    def notice(self) -> str:
        if not self.dropped_messages:
            return ""
        return (f"The conversation is longer than the context window: the oldest "
                f"{self.dropped_messages} message(s) were left out of the prompt.")


def supports_thinking(tokenizer) -> bool:
    """Whether the template has Qwen3's thinking switch."""
    return "enable_thinking" in (tokenizer.chat_template or "")


def _text(content) -> str:
    # Gradio and OpenAI clients may send content as a list of parts: keep the text parts.
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    if isinstance(content, dict):
        return str(content.get("text", ""))
    return str(content)


def normalize_messages(messages: list[dict], system_prompt: str | None = None) -> list[dict]:
    """OpenAI-style messages -> what the template expects (str content, known roles)."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ChatInputError(f"message {i} is not an object with a 'role'")
        role = message["role"]
        if role not in ("system", "user", "assistant", "tool"):
            raise ChatInputError(f"message {i} has unknown role {role!r}")
        item = {"role": role, "content": _text(message.get("content"))}
        if role == "assistant" and message.get("reasoning_content"):
            item["reasoning_content"] = _text(message["reasoning_content"])
        out.append(item)
    if system_prompt and system_prompt.strip():
        out = [m for m in out if m["role"] != "system"]
        out.insert(0, {"role": "system", "content": system_prompt})
    return out


def render_prompt(tokenizer, messages: list[dict], *, system_prompt: str | None = None,
                  thinking: bool = True) -> str:
    if not tokenizer.chat_template:
        raise ChatInputError(
            "this model has no chat template (tokenizer.chat_template is empty): it is a base "
            "model or its tokenizer files are incomplete; pick an instruct/chat model")
    msgs = normalize_messages(messages, system_prompt)
    if not msgs or msgs[-1]["role"] not in ("user", "tool"):
        raise ChatInputError("the conversation must end with a user message")
    kwargs = {"enable_thinking": thinking} if supports_thinking(tokenizer) else {}
    return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                         **kwargs)


def prepare_prompt(tokenizer, messages: list[dict], *, context_tokens: int,
                   reserve_tokens: int, system_prompt: str | None = None,
                   thinking: bool = True) -> PreparedPrompt:
    """Render and tokenize, dropping the oldest turns until prompt + reply fit the context.

    The system message and the newest user turn are always kept; if those alone do not fit,
    the input is refused with the numbers, rather than silently cut mid-message.
    """
    msgs = normalize_messages(messages, system_prompt)
    system = [m for m in msgs if m["role"] == "system"][:1]
    turns = [m for m in msgs if m not in system]
    budget = context_tokens - reserve_tokens
    dropped = 0
    while True:
        text = render_prompt(tokenizer, system + turns, thinking=thinking)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= budget:
            return PreparedPrompt(text, ids, dropped)
        # Drop the oldest turn, then any assistant/tool turns that would now lead.
        if len(turns) <= 1:
            raise ChatInputError(
                f"the message is {len(ids)} tokens long and the context window leaves room "
                f"for {max(budget, 0)} ({context_tokens} minus {reserve_tokens} for the reply): "
                "shorten it or lower max_new_tokens")
        turns = turns[1:]
        dropped += 1
        while len(turns) > 1 and turns[0]["role"] != "user":
            turns = turns[1:]
            dropped += 1


def split_reasoning(text: str) -> tuple[str, str]:
    """Decoded reply -> (reasoning, answer). Works on partial text while streaming.

    Qwen3 writes "<think>\\n...\\n</think>\\n\\n" before the answer when thinking is on. Until
    </think> arrives, everything after <think> is reasoning.
    """
    stripped = text.lstrip()
    if THINK_CLOSE in text:
        before, after = text.split(THINK_CLOSE, 1)
        return before.split(THINK_OPEN, 1)[-1].strip("\n"), after.lstrip("\n")
    if stripped.startswith(THINK_OPEN):
        return stripped[len(THINK_OPEN):].lstrip("\n"), ""
    return "", text
