"""A reply's tokens as ChatUpdates, shared by every engine that decodes itself (the local one
and the tensor-parallel one): the prompt prepared for the settings, then each token decoded
once and split once into reasoning and answer, so the work per token does not grow with the
reply."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace

from model_utils.runtime.generation import IncrementalDetokenizer
from model_utils.runtime.generation_settings import GenerationSettings
from model_utils.runtime.reply_stats import ReplyStats

from .prompt import PreparedPrompt, prepare_prompt
from .reasoning import (
    EMPTY_TEXT,
    ReasoningDelta,
    ReasoningSplitter,
    ReplyText,
    prompt_opens_thinking,
)
from .updates import ChatUpdate, TokenLogprob


def prepare_reply(tokenizer, messages: list[dict], settings: GenerationSettings, *,
                  context_tokens: int, system_prompt: str | None, thinking: bool,
                  tools: list[dict] | None = None) -> tuple[PreparedPrompt, GenerationSettings]:
    """The prompt, and the settings with max_new_tokens cut to what the context leaves (the
    prompt's notice says so when a longer reply was asked for). A max_new_tokens of exactly
    the context window (the default where the model's generation_config sets none, and the
    slider at its end) means "as long as the context leaves": cut without a notice."""
    open_ended = settings.max_new_tokens == context_tokens
    prompt = prepare_prompt(tokenizer, messages, context_tokens=context_tokens,
                            reserve_tokens=None if open_ended else settings.max_new_tokens,
                            system_prompt=system_prompt, thinking=thinking, tools=tools)
    if open_ended or prompt.reply_clamped:
        settings = replace(settings, max_new_tokens=prompt.max_new_tokens,
                           min_new_tokens=min(settings.min_new_tokens, prompt.max_new_tokens))
    return prompt, settings


class _AllAnswer:
    """The splitter of a reply that has no reasoning block (its format has none: a
    "</think>" in it is text, inside a JSON string say)."""

    def feed(self, piece: str) -> ReasoningDelta:
        return ReasoningDelta(answer=piece)

    def finish(self) -> ReasoningDelta:
        return ReasoningDelta()


def reply_updates(tokens: Iterable[int], tokenizer, prompt: PreparedPrompt, stats: ReplyStats,
                  *, before_end: Callable[[], None] = lambda: None,
                  reasoning: bool = True,
                  logprob_of: Callable[[int, int], TokenLogprob] | None = None
                  ) -> Iterator[ChatUpdate]:
    """One update per token that adds text, then the last one (done, with the stats).
    `before_end` runs when the tokens have run out, before the last update (a shutting-down
    engine raises there). reasoning False: the reply is all answer. logprob_of(i, token): the
    i-th token's TokenLogprob, for each update's `logprobs` (a token that adds no text yet
    goes with the next update that does)."""
    detok = IncrementalDetokenizer(tokenizer)
    splitter = ReasoningSplitter(opened=prompt_opens_thinking(prompt.text)) if reasoning \
        else _AllAnswer()
    reply, text = ReplyText(), EMPTY_TEXT
    pending: list[TokenLogprob] = []
    for i, token in enumerate(tokens):
        if logprob_of is not None:
            pending.append(logprob_of(i, token))
        piece = detok.push(token)
        delta = splitter.feed(piece) if piece else None
        if delta:
            text = reply.add(delta)
            yield ChatUpdate.of(delta, text, notice=prompt.notice, logprobs=pending)
            pending = []
    before_end()
    rest = detok.flush()  # a character the reply's last tokens left unfinished
    last = (splitter.feed(rest) if rest else ReasoningDelta()).then(splitter.finish())
    yield ChatUpdate.of(last, reply.add(last), done=True, stats=stats, notice=prompt.notice,
                        logprobs=pending)
