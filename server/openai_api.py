"""An OpenAI-compatible API beside the page: /v1/chat/completions, /v1/completions, /v1/models.

    curl http://127.0.0.1:7860/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "Hello"}], "stream": true}'

Why beside gradio's queue rather than through it: every request there joins a queue, gets a
session state built from all the page's components and streams through the queue's message
machinery, all on one event loop; with many clients that machinery, not the model, set the pace
(BENCHMARKS.md, many users through the HTTP APIs). Here a request is one HTTP call whose reply
streams as server-sent events straight from the engine, which batches concurrent replies alike.

What it takes (request_models.ChatCompletionRequest): messages (an optional leading system or
developer message, then user/assistant/tool turns ending with a user or tool one; content a
string or a list of text parts; an assistant turn's tool_calls), tools, tool_choice,
parallel_tool_calls and response_format (openai_tools.py), logprobs and top_logprobs, stream,
stream_options.include_usage, max_tokens (or max_completion_tokens), temperature, top_p, seed,
stop (a string or a list of strings), and the extensions top_k, repetition_penalty and
enable_thinking (or chat_template_kwargs {"enable_thinking": ...}, as other Qwen servers take
it). /v1/completions: openai_completions.py. The model field is ignored: the loaded model
answers, under the id /v1/models lists ("demo" or its folder's name, with max_model_len and
default_settings, the generation_config's sampling values). Reasoning
(Qwen3 thinking) comes as reasoning_content beside content. With logins (--auth), send one as
a bearer token "user:password" or as HTTP basic auth.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from model_utils.chat.tool_calls import ToolCall
from model_utils.chat.updates import TokenLogprob

from .client_gone import reply_threads, run_until_gone
from .common import reply_concurrency
from .conversation import MAX_TURNS
from .errors import ClientError, client_error, hide_paths, models_dir_of
from .guards import REALM, login_user
from .openai_completions import register_completions
from .openai_models import model_id, sampling_defaults
from .openai_tools import ToolCallStream, call_deltas, output_format
from .replies import make_settings, paced
from .request_models import ChatCompletionRequest, parse_json
from .stop_strings import StopFollower, StopStrings

if TYPE_CHECKING:
    from model_utils.chat.updates import ChatUpdate
    from model_utils.engine import Engine

log = logging.getLogger("ui")

_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def error_body(error: ClientError) -> dict:
    return {"error": {"message": error.message, "type": error.kind, "param": error.param,
                      "code": None}}


def error_response(error: ClientError) -> JSONResponse:
    headers = {}
    retry_after = error.retry_after or ("1" if error.status == 503 else None)
    if retry_after:
        headers["Retry-After"] = retry_after
    if error.status == 401:
        headers["WWW-Authenticate"] = REALM
    return JSONResponse(error_body(error), status_code=error.status, headers=headers)


def register_openai_api(app: FastAPI | APIRouter, engine: Engine,
                        logins: list[tuple[str, str]] | None = None) -> None:
    """Add the routes to gradio's FastAPI app (or to a router handed to it). The checks every
    request passes first (Host, Content-Type, body) are guards.request_guard's."""
    models_dir = models_dir_of(engine)
    threads = reply_threads(reply_concurrency(engine))

    def refused(error: BaseException, call: ChatCall | None = None, *,
                context: str = "openai chat") -> JSONResponse:
        """The error's answer; `context` names the endpoint in the log line of a failure."""
        mapped = client_error(error, context=context)
        message = mapped.message if not logins else hide_paths(mapped.message, models_dir)
        if call is not None:  # the engine's name for the reply length -> the client's
            message = message.replace("max_new_tokens", call.max_tokens_field)
            if mapped.param == "max_new_tokens":
                mapped.param = call.max_tokens_field
        mapped.message = message
        return error_response(mapped)

    def check_login(request: Request) -> None:
        if logins and not login_user(request.headers.get("authorization", ""), logins):
            raise ClientError(401, "a login is required: Authorization: Bearer user:password")

    async def models(request: Request):
        try:
            check_login(request)
        except ClientError as error:
            return error_response(error)
        status = engine.status()
        if not status.get("loaded"):
            return {"object": "list", "data": []}
        entry = {"id": model_id(status), "object": "model", "created": 0, "owned_by": "local"}
        # As vLLM says them; an instance of this app in front of this one reads both.
        if status.get("context_tokens"):
            entry["max_model_len"] = status["context_tokens"]
        if defaults := sampling_defaults(engine):
            entry["default_settings"] = defaults
        return {"object": "list", "data": [entry]}

    async def chat_completions(request: Request):
        call = None
        try:
            check_login(request)
            call = ChatCall.parse(parse_json(await request.body()))
            log.info("openai chat: %d messages, stream=%s, %d stop strings, settings %s",
                     len(call.messages), call.stream, len(call.stops.stops),
                     call.settings.as_dict())
            extra = {"output_format": call.output_format} if call.output_format else {}
            if call.logprobs is not None:
                extra["logprobs"] = call.logprobs
            updates = engine.chat(call.messages, call.settings, system_prompt=call.system,
                                  thinking=call.thinking, stop=call.stop, **extra)
            # The first update is awaited here, so that refused input becomes an HTTP error.
            first = await run_until_gone(request, call.stop, threads, next, updates)
        except Exception as error:  # noqa: BLE001 - mapped: 4xx for input, 503, else 500
            return refused(error, call)
        if call.stop.is_set():  # the client went away before the first token: no one to send to
            updates.close()
            return error_response(ClientError(499, "the client closed the connection"))
        model = model_id(engine.status())
        if call.stream:
            return StreamingResponse(stream_events(call, model, first, updates, refused,
                                                   request=request, threads=threads),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            final = await run_until_gone(request, call.stop, threads, whole_reply, call, first,
                                         updates)
        except Exception as error:  # noqa: BLE001 - a failure mid-reply (or a shutdown)
            return refused(error, call)
        finally:
            call.stop.set()
            with contextlib.suppress(ValueError):  # a step left running: see stream_events
                updates.close()
        last = final[1]  # whole_reply: (the reply, its last update)
        if last.stats is not None and last.stats.finish_reason == "error":
            # A model server that failed mid-reply: not a complete answer.
            return error_response(ClientError(502, last.notice, kind="backend_error"))
        return completion(call, model, final)

    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    register_completions(app, engine, check_login,
                         functools.partial(refused, context="openai completions"),
                         lambda: model_id(engine.status()))


# -- the request --------------------------------------------------------------------------------
class ChatCall:
    """One parsed request: the engine's messages and settings, and the reply's identity."""

    def __init__(self, body: ChatCompletionRequest, messages: list[dict], system: str | None):
        self.messages, self.system = messages, system
        self.settings = make_settings(body.setting_values())
        thinking = body.enable_thinking
        if thinking is None and body.chat_template_kwargs is not None:
            thinking = body.chat_template_kwargs.enable_thinking
        self.thinking = thinking is not False
        self.stream = body.stream
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.stops = StopStrings(body.stop or [])
        self.max_tokens_field = body.max_tokens_field()
        self.output_format = output_format(body)
        self.logprobs = body.logprob_alternatives()
        self.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.stop = threading.Event()

    @classmethod
    def parse(cls, data) -> ChatCall:
        if not isinstance(data, dict):
            raise ClientError(400, "the body must be a JSON object")
        body = ChatCompletionRequest.model_validate(data)
        if len(body.messages) > MAX_TURNS:
            raise ClientError(400, f"messages has {len(body.messages)} messages; at most "
                              f"{MAX_TURNS}", param="messages")
        turns = [m.engine_message() for m in body.messages]
        system = turns.pop(0)["content"] if turns and turns[0]["role"] == "system" else None
        late = next((i for i, t in enumerate(turns) if t["role"] == "system"), None)
        if late is not None:
            raise ClientError(400, f"message {late + (system is not None)}: a system message "
                              "may only come first", param="messages")
        if not turns or turns[-1]["role"] not in ("user", "tool"):
            raise ClientError(400, "messages must end with a user message (or a tool result)",
                              param="messages")
        if turns[-1]["role"] == "user" and not turns[-1]["content"].strip():
            raise ClientError(400, "the last user message is empty", param="messages")
        return cls(body, turns, system)


# -- the reply ----------------------------------------------------------------------------------
class Reply:
    """Follows the engine's deltas: the reasoning and the answer so far (appended, never
    re-split), the answer cut at the first stop string, and what the last update added to
    each (new_reasoning, new_answer: the stream's deltas)."""

    def __init__(self, call: ChatCall):
        self.call = call
        self.stops = StopFollower(call.stops)
        self.tools = ToolCallStream(call.output_format)
        self.logprobs: list[dict] = []  # every token's, in OpenAI's shape
        self.new_logprobs: list[dict] = []
        self._reasoning: list[str] = []
        self._answer: list[str] = []
        self.new_reasoning = self.new_answer = ""
        self.new_calls: list[ToolCall] = []

    @property
    def hit_stop(self) -> bool:
        return self.stops.hit

    @property
    def reasoning(self) -> str:
        return "".join(self._reasoning)

    @property
    def answer(self) -> str:
        return "".join(self._answer)

    def follow(self, update: ChatUpdate) -> None:
        if update.resplit:  # the answer so far was reasoning: it starts again
            self._reasoning, self._answer = [], []
            self.stops.restart()
        self.new_reasoning = update.reasoning_delta
        if self.hit_stop:
            # The engine is ending the reply; what it adds is past the stop string.
            self.new_answer = ""
        else:
            self.new_answer = self.stops.feed(update.answer_delta)
            if self.hit_stop:
                self.call.stop.set()  # frees the reply's place within a decode step
            elif update.done:
                self.new_answer += self.stops.finish()
        self.new_logprobs = [logprob_entry(t) for t in update.logprobs]
        self.logprobs += self.new_logprobs
        self.new_answer, self.new_calls = self.tools.feed(
            self.new_answer, done=update.done or self.hit_stop)
        if self.new_reasoning:
            self._reasoning.append(self.new_reasoning)
        if self.new_answer:
            self._answer.append(self.new_answer)

    @property
    def calls(self) -> list[ToolCall]:
        return self.tools.calls

    def finish_reason(self, update: ChatUpdate) -> str:
        if self.calls and (self.hit_stop or update.stats.finish_reason in ("eos", "stop")):
            return "tool_calls"
        return "stop" if self.hit_stop else _FINISH.get(update.stats.finish_reason, "stop")


def whole_reply(call: ChatCall, first: ChatUpdate, updates: Iterator[ChatUpdate]):
    reply, final = Reply(call), first
    reply.follow(first)
    for final in updates:
        reply.follow(final)
    return reply, final


def completion(call: ChatCall, model: str, result) -> dict:
    reply, final = result
    message = {"role": "assistant", "content": reply.answer}
    if reply.calls:
        message["content"] = reply.answer or None
        message["tool_calls"] = [c.as_openai() for c in reply.calls]
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    return {"id": call.id, "object": "chat.completion", "created": call.created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": logprobs_of(call, reply),
                         "finish_reason": reply.finish_reason(final)}],
            "usage": usage(final.stats)}


def logprob_entry(token: TokenLogprob) -> dict:
    """One token in OpenAI's logprobs shape (its text, log-probability, UTF-8 bytes, and the
    alternatives alike)."""
    def one(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {**one(token.token, token.logprob),
            "top_logprobs": [one(text, lp) for text, lp in token.top]}


def logprobs_of(call: ChatCall, reply: Reply) -> dict | None:
    """choices[].logprobs: every token of the reply (reasoning and answer), when asked for."""
    return {"content": reply.logprobs} if call.logprobs is not None else None


def usage(stats) -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens found in the KV cache (the earlier
    turns of a conversation, a shared system prompt), as OpenAI reports its prompt caching."""
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens,
            "prompt_tokens_details": {"cached_tokens": getattr(stats, "cached_tokens", 0)}}


async def stream_events(call: ChatCall, model: str, first: ChatUpdate,
                        updates: Iterator[ChatUpdate], refused, *, request: Request | None = None,
                        threads: anyio.CapacityLimiter | None = None) -> AsyncIterator[str]:
    """Server-sent events: a role chunk, content (and reasoning) deltas, a finish chunk, the
    usage when asked for, then [DONE]. A failure after the start (a device error, the server
    shutting down) is an error event, then [DONE]. A client that leaves early sets the stop
    signal within DISCONNECT_POLL_S (client_gone.py), which frees the reply's place in the
    batch within a step, and a model server's connection at once."""

    def event(data: dict) -> str:
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    def chunk(delta: dict, finish: str | None = None, logprobs: list | None = None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        if call.logprobs is not None:
            choice["logprobs"] = {"content": logprobs or []}
        return event({"id": call.id, "object": "chat.completion.chunk",
                      "created": call.created, "model": model, "choices": [choice]})

    reply = Reply(call)
    paced_updates = paced(_prepend(first, updates))
    try:
        yield chunk({"role": "assistant", "content": ""})
        while True:
            update = await run_until_gone(request, call.stop, threads, next, paced_updates,
                                          None)
            if update is None:
                break
            reply.follow(update)
            delta = {}
            if reply.new_reasoning:
                delta["reasoning_content"] = reply.new_reasoning
            if reply.new_answer:
                delta["content"] = reply.new_answer
            if reply.new_calls:
                delta["tool_calls"] = call_deltas(reply.new_calls,
                                                  len(reply.calls) - len(reply.new_calls))
            if delta or reply.new_logprobs:
                yield chunk(delta, logprobs=reply.new_logprobs)
            if update.done and update.stats.finish_reason == "error":
                # A model server that failed mid-reply: reported in band, as other failures.
                yield event(error_body(ClientError(502, update.notice, kind="backend_error")))
                break
            if update.done:
                yield chunk({}, reply.finish_reason(update))
                if call.include_usage:
                    yield event({"id": call.id, "object": "chat.completion.chunk",
                                 "created": call.created, "model": model, "choices": [],
                                 "usage": usage(update.stats)})
                break
    except Exception as error:  # noqa: BLE001 - the stream has started: report in band
        yield event(json.loads(refused(error, call).body))
    finally:
        call.stop.set()
        # ValueError: a step still running on its thread (left behind after FINISH_WAIT_S);
        # the stop event ends it, and its own finally frees the reply's place.
        with contextlib.suppress(ValueError):
            paced_updates.close()
            updates.close()  # ends engine.chat even if the stream never started (logs it)
    yield "data: [DONE]\n\n"


def _prepend(first: ChatUpdate, updates: Iterator[ChatUpdate]) -> Iterator[ChatUpdate]:
    try:
        yield first
        yield from updates
    finally:
        updates.close()
