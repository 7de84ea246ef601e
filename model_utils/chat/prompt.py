"""Messages -> the prompt the model receives, through the tokenizer's own chat template.

The template is the model's contract: Qwen3's decides where <think> goes, how an earlier
assistant turn's reasoning is dropped, and what enable_thinking=False inserts. So this module
never formats ChatML itself; it normalises messages, calls apply_chat_template, and trims the
oldest turns when the conversation outgrows the context window.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass

from model_utils.errors import ChatInputError

# Bounds on what is rendered and tokenized at all, checked before either (a request over them
# is refused, whatever path it came by): the UI keeps at most 2000 turns of history, plus the
# new message and a system prompt; a million characters is some 250 000 tokens of English,
# beyond any context window this app serves, and costs about a second to tokenize.
MAX_MESSAGES = 2048
MAX_PROMPT_CHARS = 1_000_000
# A reply without a length of its own keeps at least this much of the window when the oldest
# turns must go (at most half the window): the answer to a long conversation still has room.
OPEN_REPLY_ROOM = 4096
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class PreparedPrompt:
    text: str
    input_ids: list[int]
    dropped_messages: int  # oldest non-system messages left out to fit the context
    # The reply's length limit: what was asked, or less when the context has less room left.
    max_new_tokens: int | None = None
    requested_new_tokens: int | None = None
    context_tokens: int = 0

    @property
    def reply_clamped(self) -> bool:
        return self.max_new_tokens is not None and self.requested_new_tokens is not None \
            and self.max_new_tokens < self.requested_new_tokens

    @property
    def notice(self) -> str:
        notes = []
        if self.dropped_messages:
            notes.append(f"The conversation is longer than the context window: the oldest "
                         f"{self.dropped_messages} message(s) were left out of the prompt.")
        if self.reply_clamped:
            notes.append(f"The reply is limited to {self.max_new_tokens} tokens (asked: "
                         f"{self.requested_new_tokens}): that is what the context window of "
                         f"{self.context_tokens} tokens leaves after the prompt's "
                         f"{len(self.input_ids)}.")
        return " ".join(notes)


def supports_thinking(tokenizer) -> bool:
    """Whether the template has Qwen3's thinking switch."""
    return "enable_thinking" in (tokenizer.chat_template or "")


def _check_text(text: str, where: str) -> str:
    # A lone surrogate (JSON allows "\ud800") is not text: tokenizers raise a TypeError on it.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ChatInputError(f"{where} contains an invalid character (a lone UTF-16 "
                             "surrogate): send valid Unicode text") from None
    return text


def _kind(value) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, (list, tuple)):
        return "a list"
    return f"a {type(value).__name__}"


def _text(content, where: str) -> str:
    """Content -> str: a string, nothing (None), or a list of text parts as OpenAI and Gradio
    send them ({"type": "text", "text": ...}, or plain strings); anything else is refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        return _check_text(content, where)
    if isinstance(content, dict):
        content = [content]
    if isinstance(content, list):
        pieces = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                pieces.append(_check_text(part, f"{where}, part {j},"))
            elif isinstance(part, dict) and part.get("type", "text") == "text" and \
                    isinstance(part.get("text"), str):
                pieces.append(_check_text(part["text"], f"{where}, part {j},"))
            elif isinstance(part, dict) and part.get("type", "text") != "text":
                raise ChatInputError(f"{where}: part {j} is of type {str(part['type'])[:40]!r}; "
                                     "only text parts are supported")
            else:
                raise ChatInputError(f"{where}: part {j} must be a string or "
                                     '{"type": "text", "text": "..."}')
        return "".join(pieces)
    raise ChatInputError(f"{where}: content must be text, got {_kind(content)}")


def normalize_messages(messages: list[dict], system_prompt: str | None = None) -> list[dict]:
    """OpenAI-style messages -> what the template expects (str content, known roles).

    Every type is checked here, and the size bounds (MAX_MESSAGES, MAX_PROMPT_CHARS), so that
    bad input is a ChatInputError with a plain message on every path, before any rendering or
    tokenizing is paid for."""
    if not isinstance(messages, (list, tuple)):
        raise ChatInputError(f"messages must be a list of {{role, content}} objects, got "
                             f"{_kind(messages)}")
    if len(messages) > MAX_MESSAGES:
        raise ChatInputError(f"the conversation has {len(messages)} messages; at most "
                             f"{MAX_MESSAGES} are accepted")
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise ChatInputError(f"the system prompt must be text, got {_kind(system_prompt)}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ChatInputError(f"message {i} is not an object with a 'role'")
        role = message["role"]
        if not isinstance(role, str) or role not in ROLES:
            shown = repr(role) if isinstance(role, str) and len(role) <= 40 else _kind(role)
            raise ChatInputError(f"message {i} has unknown role {shown}; "
                                 f"use one of {', '.join(ROLES)}")
        item = {"role": role, "content": _text(message.get("content"), f"message {i}")}
        if role == "assistant" and message.get("reasoning_content"):
            item["reasoning_content"] = _text(message["reasoning_content"],
                                              f"message {i}'s reasoning_content")
        if role == "assistant" and message.get("tool_calls"):
            item["tool_calls"] = _tool_calls(message["tool_calls"], f"message {i}")
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if isinstance(message.get(key), str):
                    item[key] = message[key]
        out.append(item)
    if system_prompt and system_prompt.strip():
        _check_text(system_prompt, "the system prompt")
        out = [m for m in out if m["role"] != "system"]
        out.insert(0, {"role": "system", "content": system_prompt})
    chars = sum(len(m["content"]) + len(m.get("reasoning_content", "")) for m in out)
    if chars > MAX_PROMPT_CHARS:
        raise ChatInputError(f"the conversation is {chars} characters long; at most "
                             f"{MAX_PROMPT_CHARS} are accepted")
    return out


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant turn's OpenAI tool_calls -> what chat templates read: {"type": "function",
    "function": {"name", "arguments"}}, the arguments as an object where they are JSON text
    (Qwen2.5's template writes `arguments | tojson`, which would quote a string again)."""
    if not isinstance(calls, list):
        raise ChatInputError(f"{where}: tool_calls must be a list, got {_kind(calls)}")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ChatInputError(f'{where}: tool call {j} must be {{"type": "function", '
                                 '"function": {"name": ..., "arguments": ...}}')
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                parsed = None
            arguments = parsed if isinstance(parsed, dict) else arguments
        entry = {"type": "function", "function": {"name": _check_text(function["name"], where),
                                                  "arguments": arguments}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def _check_template(tokenizer) -> None:
    if not tokenizer.chat_template:
        raise ChatInputError(
            "this model has no chat template (tokenizer.chat_template is empty): it is a base "
            "model or its tokenizer files are incomplete; pick an instruct/chat model")


def _render(tokenizer, msgs: list[dict], thinking: bool, tools: list[dict] | None = None) -> str:
    """Normalised messages -> the prompt text, through the model's own template (which
    describes `tools`, OpenAI's function tools, to the model in its own words)."""
    if not msgs or msgs[-1]["role"] not in ("user", "tool"):
        raise ChatInputError("the conversation must end with a user message")
    kwargs = {"enable_thinking": thinking} if supports_thinking(tokenizer) else {}
    if tools:
        kwargs["tools"] = tools
    return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                         **kwargs)


def render_prompt(tokenizer, messages: list[dict], *, system_prompt: str | None = None,
                  thinking: bool = True, tools: list[dict] | None = None) -> str:
    _check_template(tokenizer)
    return _render(tokenizer, normalize_messages(messages, system_prompt), thinking, tools)


def prepare_prompt(tokenizer, messages: list[dict], *, context_tokens: int,
                   reserve_tokens: int | None, system_prompt: str | None = None,
                   thinking: bool = True, tools: list[dict] | None = None) -> PreparedPrompt:
    """Render and tokenize, leaving out the oldest turns until prompt + reply fit the context.

    The system message and the newest user turn are always kept. The reply keeps the room it
    asked for (reserve_tokens, at most half the window: a very long reply does not push the
    whole conversation out); when what is kept leaves less, the reply is limited to what is
    left (PreparedPrompt.max_new_tokens, with a notice). reserve_tokens None: a reply as long
    as the context leaves (no notice), the oldest turns left out only to keep OPEN_REPLY_ROOM
    for it. Only a prompt that leaves no room at all is refused, with the numbers, rather than
    cut mid-message.

    Linear in the conversation: the whole conversation is rendered once (the usual case, it
    fits); if it does not, each turn is tokenized once, the cut is estimated from those counts
    by bisection and then settled with a few renders of what is kept, galloping from the
    estimate (a render per dropped turn, as before, cost 25 s of CPU for 2000 short turns).
    """
    _check_template(tokenizer)
    msgs = normalize_messages(messages, system_prompt)
    first_system = next((i for i, m in enumerate(msgs) if m["role"] == "system"), None)
    system = [msgs[first_system]] if first_system is not None else []
    turns = [m for i, m in enumerate(msgs) if i != first_system]
    reserve = OPEN_REPLY_ROOM if reserve_tokens is None else reserve_tokens
    budget = context_tokens - min(reserve, context_tokens // 2)
    encoded: dict[int, tuple[str, list[int]]] = {}

    def encode(cut: int) -> tuple[str, list[int]]:  # the prompt without turns[:cut]
        if cut not in encoded:
            text = _render(tokenizer, system + turns[cut:], thinking, tools)
            encoded[cut] = text, tokenizer(text, add_special_tokens=False)["input_ids"]
        return encoded[cut]

    cut = 0
    if len(encode(0)[1]) > budget and len(turns) > 1:
        cut = _find_cut(tokenizer, turns, budget, encode)
    text, ids = encode(cut)
    room = context_tokens - len(ids)
    if room < 1:
        raise ChatInputError(
            f"the message is {len(ids)} tokens long and leaves no room for a reply in the "
            f"context window of {context_tokens} tokens: shorten it")
    return PreparedPrompt(text, ids, cut, max_new_tokens=min(reserve_tokens or room, room),
                          requested_new_tokens=reserve_tokens, context_tokens=context_tokens)


def _find_cut(tokenizer, turns: list[dict], budget: int, encode) -> int:
    """The fewest oldest turns to leave out so that the prompt fits `budget` tokens; what is
    kept starts with a user turn (or is the last turn alone). encode(cut) is exact but costs a
    render; the per-turn token counts give a close first guess."""
    cuts = [c for c in range(1, len(turns) - 1) if turns[c]["role"] == "user"]
    cuts.append(len(turns) - 1)
    full = len(encode(0)[1])
    lengths = [len(ids) for ids in tokenizer([m["content"] for m in turns],
                                             add_special_tokens=False)["input_ids"]]
    # The template's own tokens, shared out per turn (role markers, newlines).
    overhead = max(0.0, (full - sum(lengths)) / (len(turns) + 1))
    dropped = [0.0]
    for length in lengths:
        dropped.append(dropped[-1] + length + overhead)  # dropped[c]: tokens saved by cut c
    estimate = bisect.bisect_left(cuts, 0, key=lambda c: 0 if full - dropped[c] <= budget else -1)
    estimate = min(estimate, len(cuts) - 1)

    def fits(i: int) -> bool:
        return len(encode(cuts[i])[1]) <= budget

    # Gallop from the estimate to a bracket [lo, hi] with fits(hi) and not fits(lo) (lo = -1:
    # no cut at all, known not to fit), then bisect inside it.
    lo, hi = -1, len(cuts) - 1
    step = 1
    if fits(estimate):
        hi = estimate
        while hi - step > lo:
            if fits(hi - step):
                hi -= step
                step *= 2
            else:
                lo = hi - step
                break
    else:
        lo = estimate
        while lo + step < hi:
            if fits(lo + step):
                hi = lo + step
                break
            lo += step
            step *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return cuts[hi]
