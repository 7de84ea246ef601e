"""POST /v1/completions: OpenAI's text completion, for clients that send a prompt without a chat
template (lm-eval's local-completions, scripts that score text).

    curl http://127.0.0.1:7860/v1/completions -H 'Content-Type: application/json' \\
        -d '{"prompt": "The capital of France is", "max_tokens": 8, "logprobs": 2}'

It takes `prompt` (a string, or token ids of the model's vocabulary: another id is a 400; a
list of either for several prompts, each its own choice), `max_tokens` (default 16; 0 with
`echo`: the prompt scored, nothing generated), `temperature`, `top_p`, `seed`, `stop`,
`logprobs` (0-20 alternatives per token) and `echo` (the prompt is given back before the
continuation, and with `logprobs` its tokens are scored too: the first one's log-probability is
null, as OpenAI's is), `stream` (one prompt: server-sent events, a chunk per piece of text);
one choice per prompt (n or best_of above 1, suffix and an empty prompt are a 400). The same
logins, limits and error shapes as /v1/chat/completions.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from typing import Annotated, Any

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from model_utils.chat.updates import TokenLogprob
from model_utils.runtime.generation_settings import BY_NAME

from .errors import ClientError
from .replies import make_settings
from .request_models import check_text, parse_json, setting_type
from .stop_strings import StopFollower, StopStrings

MAX_PROMPTS = 64
# The settings' own checks, so that a value is refused in the chat endpoint's words. A
# max_tokens of 0 is allowed here: with echo, the prompt scored and nothing generated.
MaxTokens = setting_type(replace(BY_NAME["max_new_tokens"], low=0))
Temperature = setting_type(BY_NAME["temperature"])
TopP = setting_type(BY_NAME["top_p"])
TopK = setting_type(BY_NAME["top_k"])
RepetitionPenalty = setting_type(BY_NAME["repetition_penalty"])
Seed = setting_type(BY_NAME["seed"])


class CompletionRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    prompt: Any
    max_tokens: MaxTokens = 16
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    repetition_penalty: RepetitionPenalty | None = None
    seed: Seed | None = None
    stop: Any = None
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    stream: bool = False
    n: int | None = None
    best_of: int | None = None
    suffix: Any = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value: Any) -> list:
        """A string, token ids, or a list of either -> a list of prompts (str or list[int])."""
        def one(p):
            if p == "":  # nothing to continue (a token-id prompt may not be empty either)
                raise ValueError("a prompt is empty: give text or token ids to continue")
            if isinstance(p, str):
                return check_text(p)
            if isinstance(p, list) and p and all(isinstance(t, int) and t >= 0 for t in p):
                return p
            raise ValueError("must be a string, a list of token ids, or a list of those")

        if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
            return [one(value)]
        prompts = [one(p) for p in value] if isinstance(value, list) else [one(value)]
        if not 1 <= len(prompts) <= MAX_PROMPTS:
            raise ValueError(f"give 1 to {MAX_PROMPTS} prompts")
        return prompts

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> list[str]:
        values = [] if value is None else [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
            raise ValueError("must be a string or a list of non-empty strings")
        return values[:16]

    def refuse_unsupported(self) -> None:
        # One choice per prompt: n and best_of would ask for more (and best_of is not ignored:
        # a client that sends it relies on the best of several).
        for name, asks in (("stream", self.stream and len(self.prompt) > 1),
                           ("n", self.n not in (None, 1)),
                           ("best_of", self.best_of not in (None, 1)),
                           ("suffix", self.suffix is not None)):
            if asks:
                raise ClientError(400, f"{name} is not supported on /v1/completions"
                                  + (" with several prompts" if name == "stream" else ""),
                                  param=name)


def register_completions(app, engine, check_login, refused, model_name) -> None:
    """Add the route; `check_login`, `refused` and `model_name()` (the id replies carry) are
    the chat endpoint's own."""

    async def completions(request: Request):
        try:
            check_login(request)
            if not hasattr(engine, "manager"):  # a model server's (--backend): no tokenizer here
                raise ClientError(501, "text completions are not passed on to the model server "
                                       "(--backend): use the chat completions endpoint")
            data = parse_json(await request.body())
            if not isinstance(data, dict):
                raise ClientError(400, "the body must be a JSON object")
            body = CompletionRequest.model_validate(data)
            body.refuse_unsupported()
            # Before anything is answered: a stream or an echo would have begun.
            await anyio.to_thread.run_sync(check_prompt_ids, engine, body.prompt)
            settings = make_settings({
                "max_new_tokens": max(body.max_tokens, 1), "temperature": body.temperature,
                "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed,
                "repetition_penalty": body.repetition_penalty})
            if body.stream:
                return StreamingResponse(
                    stream_choice(engine, body, settings, model_name(), refused),
                    media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0}
            for index, prompt in enumerate(body.prompt):
                choice, prompt_tokens, new_tokens = await anyio.to_thread.run_sync(
                    one_choice, engine, body, settings, prompt)
                choices.append({"index": index, **choice})
                usage["prompt_tokens"] += prompt_tokens
                usage["completion_tokens"] += new_tokens
        except Exception as error:  # noqa: BLE001 - mapped: 4xx for input, 503, else 500
            return refused(error)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion",
                "created": int(time.time()), "model": model_name(),
                "choices": choices, "usage": usage}

    app.add_api_route("/v1/completions", completions, methods=["POST"])


def check_prompt_ids(engine, prompts: list) -> None:
    """The token-id prompts' ids are the model's (an InvalidParameter "prompt" if not)."""
    from model_utils import completion  # torch: not imported by a front end (see below)

    for prompt in prompts:
        if not isinstance(prompt, str):
            completion.check_token_ids(engine, prompt)


@dataclass
class Piece:
    """What one step of a choice adds: text, its tokens' logprobs, and at the end its finish
    reason and token counts."""

    text: str
    entries: list[TokenLogprob]
    finish: str | None = None
    prompt_tokens: int = 0
    new_tokens: int = 0


def choice_pieces(engine, body: CompletionRequest, settings, prompt,
                  stop: threading.Event) -> Iterator[Piece]:
    """One prompt's choice as it is made: the prompt first (with echo), then the continuation,
    cut at the first stop string; the last piece has the finish reason."""
    # Here, not at the top: the local engine's completion (torch) is no part of a front end
    # for a model server (--backend), which imports this module too.
    from model_utils import completion

    ids = completion.encode(engine, prompt) if isinstance(prompt, str) else list(prompt)
    if body.echo:
        scored = completion.prompt_logprobs(engine, ids, body.logprobs) \
            if body.logprobs is not None else []
        yield Piece(prompt if isinstance(prompt, str) else _decode(engine, ids), scored)
    if body.max_tokens == 0:
        yield Piece("", [], "length", len(ids))
        return
    follower = StopFollower(StopStrings(body.stop or []))
    for update in completion.complete(engine, ids, settings, stop=stop,
                                      logprobs=body.logprobs):
        text = ""
        if not follower.hit:
            text = follower.feed(update.answer_delta)
            if follower.hit:
                stop.set()
            elif update.done:
                text += follower.finish()
        finish = None
        if update.done:
            finish = "stop" if follower.hit or update.stats.finish_reason == "eos" else "length"
        yield Piece(text, list(update.logprobs), finish, len(ids),
                    update.stats.new_tokens if update.done else 0)


def one_choice(engine, body: CompletionRequest, settings, prompt) -> tuple[dict, int, int]:
    """(the whole choice, its prompt's tokens, the tokens generated)."""
    pieces = list(choice_pieces(engine, body, settings, prompt, threading.Event()))
    choice = {"text": "".join(p.text for p in pieces), "finish_reason": pieces[-1].finish,
              "logprobs": None}
    if body.logprobs is not None:
        choice["logprobs"] = legacy_logprobs([e for p in pieces for e in p.entries],
                                             body.logprobs)
    return choice, pieces[-1].prompt_tokens, pieces[-1].new_tokens


async def stream_choice(engine, body: CompletionRequest, settings, model: str,
                        refused) -> AsyncIterator[str]:
    """Server-sent events of one prompt's choice: a chunk per piece (its text, and with
    logprobs its tokens'), the finish, then [DONE]; a failure after the start is an error
    event. Leaving early stops the reply."""
    stop = threading.Event()
    pieces = choice_pieces(engine, body, settings, body.prompt[0], stop)
    head = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion",
            "created": int(time.time()), "model": model}
    offset = 0
    try:
        while True:
            piece = await anyio.to_thread.run_sync(next, pieces, None)
            if piece is None:
                break
            choice = {"index": 0, "text": piece.text, "finish_reason": piece.finish,
                      "logprobs": None}
            if body.logprobs is not None:
                choice["logprobs"] = legacy_logprobs(piece.entries, body.logprobs, offset)
            offset += len(piece.text)
            if piece.text or piece.entries or piece.finish:
                yield f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"
    except Exception as error:  # noqa: BLE001 - the stream has started: report in band
        yield f"data: {refused(error).body.decode()}\n\n"
    finally:
        stop.set()
        pieces.close()
    yield "data: [DONE]\n\n"


def _decode(engine, ids: list[int]) -> str:
    with engine.manager.use() as loaded:
        return loaded.tokenizer.decode(ids)


def legacy_logprobs(entries: list[TokenLogprob], alternatives: int, start: int = 0) -> dict:
    """The completions API's logprobs: parallel lists of tokens, their log-probabilities, the
    top alternatives as {token: logprob}, and each token's offset in the text (from `start`,
    the offset of a streamed piece)."""
    tokens, values, tops, offsets, at = [], [], [], [], start
    for entry in entries:
        if entry.logprob is None:  # the prompt's first token: nothing predicts it
            tokens.append(entry.token), values.append(None), tops.append(None)
            offsets.append(at)
            at += len(entry.token)
            continue
        tokens.append(entry.token)
        values.append(entry.logprob)
        top = dict(entry.top[:alternatives]) if alternatives else {}
        top.setdefault(entry.token, entry.logprob)
        tops.append(top)
        offsets.append(at)
        at += len(entry.token)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}
