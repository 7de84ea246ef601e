"""Plain text completion (OpenAI's /v1/completions): a prompt with no chat template, its
continuation, and the prompt's own log-probabilities (`echo`), which log-likelihood
evaluations (lm-eval's loglikelihood tasks) read.

The continuation goes through the same scheduler as chat replies. The prompt's
log-probabilities come from one forward of the whole prompt on the decode worker, outside the
batch (a request waits for the replies decoding to leave the worker's queue first).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from model_utils.runtime.generation_settings import GenerationSettings
from model_utils.runtime.reply_stats import ReplyStats

from .chat.prompt import PreparedPrompt
from .chat.reply_stream import reply_updates
from .chat.updates import ChatUpdate, TokenLogprob
from .engine import token_logprobs
from .errors import ChatInputError, InvalidParameter
from .runtime.generation import LogprobRecord

if TYPE_CHECKING:
    from .engine import Engine

# Positions whose log-softmax is taken at once: bounds the float32 copy of the logits.
LOGPROB_CHUNK = 512


def encode(engine: Engine, text: str) -> list[int]:
    """A text prompt's token ids, as the tokenizer encodes it by default (a BOS where the
    model has one)."""
    with engine.manager.use() as loaded:
        return loaded.tokenizer(text)["input_ids"]


def check_token_ids(engine: Engine, ids: list[int]) -> None:
    """Refuse (InvalidParameter "prompt") token ids that name no token of the loaded model, so
    that a caller can refuse a request before it answers anything (a stream, an echo)."""
    with engine.manager.use() as loaded:
        _check_ids(loaded, ids)


def _check_ids(loaded, ids: list[int]) -> None:
    """Token ids a client sent must name tokens of this model: an id past the embedding's rows
    fails inside the model (on a GPU, a device-side assert that poisons the process), and one
    past the tokenizer's has no text. Both limits, as a checkpoint may pad either. Checked
    again where the ids are used: the model may have been switched since."""
    if not ids:  # a text that encodes to no tokens: nothing to continue or to score
        raise ChatInputError("the prompt is empty: give text or token ids to continue")
    limit = min(len(loaded.tokenizer), loaded.model.config.get_text_config().vocab_size)
    bad = next((t for t in ids if not 0 <= t < limit), None)
    if bad is not None:
        raise InvalidParameter("prompt", f"token id {bad} is not in the model's vocabulary "
                               f"(ids 0 to {limit - 1})")


def prompt_logprobs(engine: Engine, ids: list[int], k: int) -> list[TokenLogprob]:
    """Each prompt token's log-probability given the tokens before it, with `k` alternatives
    (the first token's is None: nothing predicts it)."""
    with engine.manager.use() as loaded:
        _check_ids(loaded, ids)
        tokenizer, model = loaded.tokenizer, loaded.model

        def forward():
            with torch.inference_mode():
                device = model.get_input_embeddings().weight.device
                logits = model(input_ids=torch.tensor([ids], device=device),
                               use_cache=False).logits[0]
                out = []
                for start in range(0, len(ids) - 1, LOGPROB_CHUNK):
                    stop = min(start + LOGPROB_CHUNK, len(ids) - 1)
                    logp = torch.log_softmax(logits[start:stop].float(), -1)
                    nxt = torch.tensor(ids[start + 1:stop + 1], device=logp.device)
                    chosen = logp.gather(1, nxt[:, None])[:, 0].tolist()
                    top = logp.topk(max(k, 1), -1)
                    out += [(c, list(zip(i, v))) for c, i, v in
                            zip(chosen, top.indices.tolist(), top.values.tolist())]
                return out

        rows = engine.worker.call(forward)

    def text(token_id: int) -> str:
        return tokenizer.decode([token_id])

    first = TokenLogprob(text(ids[0]), None)  # nothing predicts it: no log-probability
    return [first] + [TokenLogprob(text(t), c, tuple((text(a), lp) for a, lp in top[:k]))
                      for t, (c, top) in zip(ids[1:], rows)]


def complete(engine: Engine, ids: list[int], settings: GenerationSettings, *, stop,
             logprobs: int | None = None) -> Iterator[ChatUpdate]:
    """The continuation of `ids` as ChatUpdates (all answer, no reasoning split); max_new_tokens
    is cut to what the context leaves."""
    record = LogprobRecord(logprobs) if logprobs is not None else None
    with engine.manager.use() as loaded:
        _check_ids(loaded, ids)
        settings = settings.resolved(loaded.model.generation_config,
                                     context_tokens=loaded.context_tokens)
        room = loaded.context_tokens - len(ids)
        if room < 1:
            raise ChatInputError(f"the prompt is {len(ids)} tokens long and leaves no room in "
                                 f"the context window of {loaded.context_tokens} tokens")
        settings = replace(settings, max_new_tokens=min(settings.max_new_tokens, room),
                           min_new_tokens=min(settings.min_new_tokens, room))
        prompt = PreparedPrompt("", ids, 0, max_new_tokens=settings.max_new_tokens,
                                requested_new_tokens=settings.max_new_tokens,
                                context_tokens=loaded.context_tokens)
        stats = ReplyStats(prompt_tokens=len(ids))
        tokens = engine._tokens(loaded, ids, settings, stop, stats, None, record)
        logprob_of = None if record is None else token_logprobs(record, loaded.tokenizer,
                                                                logprobs or 0)
        try:
            for update in reply_updates(tokens, loaded.tokenizer, prompt, stats,
                                        reasoning=False, logprob_of=logprob_of):
                if update.done and record is not None and stats.finish_reason == "eos" \
                        and len(record) > stats.new_tokens:
                    # The EOS that ended it is scored too, as OpenAI's and vLLM's is (a
                    # log-likelihood of a continuation that ends the text needs it).
                    n = stats.new_tokens
                    update = replace(update, logprobs=update.logprobs + [
                        logprob_of(n, record.drawn(n))])
                yield update
        finally:
            stop.set()
