"""ChatUpdate: one step of a streamed reply, as every engine yields it (the local one and the
remote backend). Light on purpose: no torch, so the remote backend and the server layer can
import it without the engine."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from .reasoning import EMPTY_TEXT, ReasoningDelta, TextSoFar

if TYPE_CHECKING:  # the type only: runtime.generation imports torch
    from model_utils.runtime.reply_stats import ReplyStats


@dataclass(frozen=True)
class TokenLogprob:
    """One reply token's log-probability and its likeliest alternatives (text, logprob)."""

    token: str
    logprob: float | None  # None: a prompt's first token, which nothing predicts
    top: tuple[tuple[str, float], ...] = ()


@dataclass
class ChatUpdate:
    """One step of a streamed reply: the text it added (reasoning_delta, answer_delta) and, for
    a reader that shows the whole message, the text so far (reasoning, answer: joined from the
    pieces when first read, never re-decoded). `resplit`: the answer so far was reasoning after
    all (a </think> in a reply that had not opened the block): reasoning_delta is then the
    whole reasoning and answer_delta the start of a new answer (ReasoningDelta)."""

    reasoning_delta: str = ""
    answer_delta: str = ""
    done: bool = False
    stats: ReplyStats | None = None
    notice: str = ""
    resplit: bool = False
    text: TextSoFar = field(default=EMPTY_TEXT, repr=False)
    # With logprobs asked for: the tokens this update's text came from (reasoning and answer).
    logprobs: list[TokenLogprob] = field(default_factory=list, repr=False)

    @classmethod
    def of(cls, delta: ReasoningDelta, text: TextSoFar, **fields) -> ChatUpdate:
        return cls(delta.reasoning, delta.answer, resplit=delta.resplit, text=text, **fields)

    @property
    def reasoning(self) -> str:
        return self.text.reasoning

    @property
    def answer(self) -> str:
        return self.text.answer

    def followed_by(self, later: ChatUpdate) -> ChatUpdate:
        """This update and a later one as one (a consumer that skipped this one)."""
        delta = ReasoningDelta(self.reasoning_delta, self.answer_delta, self.resplit).then(
            ReasoningDelta(later.reasoning_delta, later.answer_delta, later.resplit))
        return replace(later, reasoning_delta=delta.reasoning, answer_delta=delta.answer,
                       resplit=delta.resplit, logprobs=self.logprobs + later.logprobs)
