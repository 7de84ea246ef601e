"""How much of the context window a conversation takes, before it is sent: the prompt counted
through the same preparation a reply uses (the chat template, the oldest turns left out when it
does not fit, the room kept for the reply), or, with no tokenizer at hand (a remote model
server's), an estimate from the characters that says it is one."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from model_utils.errors import ChatInputError
from model_utils.runtime.generation_settings import GenerationSettings

from .prompt import OPEN_REPLY_ROOM, normalize_messages

# The estimate: English runs at about four characters a token in Qwen's vocabulary, and the
# chat template adds a few tokens a message (role markers, newlines).
CHARS_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 4


@dataclass(frozen=True)
class PromptBudget:
    prompt_tokens: int               # the prompt as it would be sent (after any trim)
    context_tokens: int | None       # the window; None: not known (a server that does not say)
    reply_tokens: int | None         # the room kept for the reply when turns must go
    dropped_messages: int = 0        # oldest messages it would leave out
    estimated: bool = False          # characters / 4, not the model's tokenizer
    error: str = ""                  # why it could not be sent as it is (no room for a reply)

    @property
    def near_limit(self) -> bool:
        """Within a tenth of the window of leaving turns out."""
        if not self.context_tokens or self.reply_tokens is None:
            return False
        return self.prompt_tokens + self.reply_tokens >= 0.9 * self.context_tokens

    def as_dict(self) -> dict:
        return {**asdict(self), "near_limit": self.near_limit}


def _reply_room(settings: GenerationSettings, context_tokens: int) -> int:
    """What prepare_prompt keeps for the reply when it has to choose: the reply's own length
    (OPEN_REPLY_ROOM when it is "as long as the context leaves"), at most half the window."""
    asked = settings.max_new_tokens
    reserve = OPEN_REPLY_ROOM if asked is None or asked == context_tokens else asked
    return min(reserve, context_tokens // 2)


def measure_prompt(tokenizer, messages: list[dict], settings: GenerationSettings, *,
                   context_tokens: int, system_prompt: str | None,
                   thinking: bool) -> PromptBudget:
    """Count with the model's tokenizer. `settings` resolved as a reply's are (their
    max_new_tokens decides the room kept for the reply). A prompt that cannot be sent comes
    back with the error it would get, not raised: the count is only a view."""
    # Here, not at the top: the estimate (a remote backend's) needs no torch.
    from .reply_stream import prepare_reply

    room = _reply_room(settings, context_tokens)
    try:
        prompt, _ = prepare_reply(tokenizer, messages, settings, context_tokens=context_tokens,
                                  system_prompt=system_prompt, thinking=thinking)
    except ChatInputError as error:
        return PromptBudget(0, context_tokens, room, error=str(error))
    return PromptBudget(len(prompt.input_ids), context_tokens, room,
                        dropped_messages=prompt.dropped_messages)


def estimate_prompt(messages: list[dict], settings: GenerationSettings, *,
                    context_tokens: int | None, system_prompt: str | None) -> PromptBudget:
    """An estimate without a tokenizer. Nothing is left out here (a remote server is sent
    the whole conversation), so near_limit is the warning that matters."""
    try:
        msgs = normalize_messages(messages, system_prompt)
    except ChatInputError as error:
        return PromptBudget(0, context_tokens, None, estimated=True, error=str(error))
    chars = sum(len(m["content"]) + len(m.get("reasoning_content", "")) for m in msgs)
    tokens = -(-chars // CHARS_PER_TOKEN) + TOKENS_PER_MESSAGE * len(msgs)
    room = settings.max_new_tokens
    if context_tokens and room is not None:
        room = min(room, context_tokens)
    return PromptBudget(tokens, context_tokens, room, estimated=True)
