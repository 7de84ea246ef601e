"""An OpenAI-compatible chat endpoint beside the page: /v1/chat/completions and /v1/models.

    curl http://127.0.0.1:7860/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "Hello"}], "stream": true}'

Why beside gradio's queue rather than through it: every request there joins a queue, gets a
session state built from all the page's components and streams through the queue's message
machinery, all on one event loop; with many clients that machinery, not the model, set the pace
(BENCHMARKS.md, run F). Here a request is one HTTP call whose reply streams as server-sent
events straight from the engine, which batches concurrent replies the same way.

What it takes: messages (an optional leading system message, then user/assistant turns ending
with a user one), stream, max_tokens (or max_completion_tokens), temperature, top_p, seed, and
the extensions top_k, repetition_penalty and enable_thinking (or chat_template_kwargs
{"enable_thinking": ...}, as other Qwen servers take it). The model field is ignored: the
loaded model answers, and is named in the reply. Reasoning (Qwen3 thinking) comes as
reasoning_content beside content. With logins (--auth), send one as a bearer token
"user:password" or as HTTP basic auth.
"""

from __future__ import annotations

import base64
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from model_utils.engine import ChatUpdate, Engine

from .conversation import ConversationError, validate_history
from .replies import INPUT_ERRORS, make_settings, paced

log = logging.getLogger("ui")

_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error",
                 param: str | None = None, retry_after: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param
        self.retry_after = retry_after or ("1" if status == 503 else None)

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": None}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": self.retry_after} if self.retry_after else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def failure(error: Exception) -> ApiError:
    """An unexpected error while replying (a bug, a device error), logged with its trace."""
    log.exception("openai reply failed")
    return ApiError(500, f"the reply failed: {type(error).__name__}: {error}",
                    kind="server_error")


def register_openai_api(app: FastAPI, engine: Engine,
                        logins: list[tuple[str, str]] | None = None) -> None:
    """Add the routes to the running app (gradio's FastAPI app)."""

    async def models(request: Request):
        try:
            check_login(request, logins)
        except ApiError as error:
            return error.response()
        status = engine.status()
        data = [{"id": status["model"], "object": "model", "created": 0, "owned_by": "local"}] \
            if status.get("loaded") else []
        return {"object": "list", "data": data}

    async def chat_completions(request: Request):
        try:
            check_login(request, logins)
            body = await read_json(request)
            call = ChatCall.parse(body)
            log.info("openai chat: %d messages, stream=%s, settings %s", len(call.messages),
                     call.stream, call.settings.as_dict())
            updates = engine.chat(call.messages, call.settings, system_prompt=call.system,
                                  thinking=call.thinking, stop=call.stop)
            # The first update is awaited here, so that refused input becomes an HTTP error.
            first = await anyio.to_thread.run_sync(next_update, updates)
        except ApiError as error:
            return error.response()
        except INPUT_ERRORS as error:
            return api_error_for(error).response()
        except Exception as error:  # noqa: BLE001 - a bug or a device error: the app stays up
            return failure(error).response()
        model = engine.status().get("model", "")
        if call.stream:
            return StreamingResponse(stream_events(call, model, first, updates),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            final = await anyio.to_thread.run_sync(last_update, first, updates)
        except Exception as error:  # noqa: BLE001 - a device error mid-reply: say so
            return failure(error).response()
        finally:
            call.stop.set()
        if final.stats is not None and final.stats.finish_reason == "error":
            # A model server that failed mid-reply: not a complete answer.
            return ApiError(502, final.notice, kind="backend_error").response()
        return completion(call, model, final)

    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])


# -- the request --------------------------------------------------------------------------------
class ChatCall:
    def __init__(self, messages, system, settings, thinking: bool, stream: bool,
                 include_usage: bool):
        self.messages, self.system, self.settings = messages, system, settings
        self.thinking, self.stream, self.include_usage = thinking, stream, include_usage
        self.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.stop = threading.Event()

    @classmethod
    def parse(cls, body: dict) -> ChatCall:
        if body.get("n") not in (None, 1):
            raise ApiError(400, "only n=1 is supported", param="n")
        if body.get("stop"):
            raise ApiError(400, "stop sequences are not supported", param="stop")
        try:
            turns = validate_history(body.get("messages"))
        except ConversationError as error:
            raise ApiError(400, str(error), param="messages") from None
        system = turns.pop(0)["content"] if turns and turns[0]["role"] == "system" else None
        if not turns or turns[-1]["role"] != "user":
            raise ApiError(400, "messages must end with a user message", param="messages")
        if not turns[-1]["content"].strip():
            raise ApiError(400, "the last user message is empty", param="messages")
        values = {"max_new_tokens": body.get("max_completion_tokens", body.get("max_tokens"))}
        for name in ("temperature", "top_p", "top_k", "repetition_penalty", "seed"):
            values[name] = body.get(name)
        try:
            settings = make_settings({k: v for k, v in values.items() if v is not None})
        except Exception as error:  # noqa: BLE001 - make_settings names the bad setting
            raise ApiError(400, str(error)) from None
        thinking = body.get("enable_thinking")
        kwargs = body.get("chat_template_kwargs")
        if thinking is None and isinstance(kwargs, dict):
            thinking = kwargs.get("enable_thinking")
        options = body.get("stream_options")
        return cls([{"role": t["role"], "content": t["content"]} for t in turns], system,
                   settings, thinking is not False, bool(body.get("stream")),
                   isinstance(options, dict) and bool(options.get("include_usage")))


async def read_json(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(400, f"the body is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


def check_login(request: Request, logins: list[tuple[str, str]] | None) -> None:
    """With logins, the request must carry one: "Bearer user:password" or HTTP basic auth."""
    if not logins:
        return
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    given = ""
    if scheme.lower() == "bearer":
        given = value.strip()
    elif scheme.lower() == "basic":
        try:
            given = base64.b64decode(value.strip()).decode()
        except (ValueError, UnicodeDecodeError):
            given = ""
    user, _, password = given.partition(":")
    # Every login is compared, so the time taken does not tell which user exists.
    ok = False
    for known_user, known_password in logins:
        ok |= hmac.compare_digest(f"{user}:{password}".encode(),
                                  f"{known_user}:{known_password}".encode())
    if not ok:
        raise ApiError(401, "a login is required: Authorization: Bearer user:password",
                       kind="authentication_error")


def api_error_for(error: Exception) -> ApiError:
    from model_utils.manager import ModelBusy

    if isinstance(error, ModelBusy):  # QueueFull too: "busy, try again shortly"
        return ApiError(503, str(error), kind="server_busy")
    if hasattr(error, "http_status"):  # a model server's refusal (backends.errors)
        return ApiError(error.http_status, str(error), kind=error.kind,
                        retry_after=error.retry_after)
    param = getattr(error, "name", None)  # InvalidParameter names it
    status = 503 if "no model" in str(error).lower() else 400
    return ApiError(status, str(error), param=param)


# -- the reply ----------------------------------------------------------------------------------
def next_update(updates: Iterator[ChatUpdate]) -> ChatUpdate:
    return next(updates)


def last_update(first: ChatUpdate, updates: Iterator[ChatUpdate]) -> ChatUpdate:
    final = first
    for final in updates:
        pass
    return final


def completion(call: ChatCall, model: str, final: ChatUpdate) -> dict:
    message = {"role": "assistant", "content": final.answer}
    if final.reasoning:
        message["reasoning_content"] = final.reasoning
    stats = final.stats
    return {"id": call.id, "object": "chat.completion", "created": call.created, "model": model,
            "choices": [{"index": 0, "message": message,
                         "finish_reason": _FINISH.get(stats.finish_reason, "stop")}],
            "usage": usage(stats)}


def usage(stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens}


async def stream_events(call: ChatCall, model: str, first: ChatUpdate,
                        updates: Iterator[ChatUpdate]) -> AsyncIterator[str]:
    """Server-sent events: a role chunk, content (and reasoning) deltas, a finish chunk, the
    usage when asked for, then [DONE]. Leaving early (a closed connection cancels this) sets
    the stop signal, which frees the reply's place in the batch within a decode step."""

    def chunk(delta: dict, finish: str | None = None) -> str:
        data = {"id": call.id, "object": "chat.completion.chunk", "created": call.created,
                "model": model, "choices": [{"index": 0, "delta": delta,
                                             "finish_reason": finish}]}
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    sent = {"reasoning": "", "answer": ""}
    paced_updates = paced(_prepend(first, updates))
    try:
        yield chunk({"role": "assistant", "content": ""})
        while True:
            update = await anyio.to_thread.run_sync(next, paced_updates, None)
            if update is None:
                break
            delta = {}
            for field, key in (("reasoning", "reasoning_content"), ("answer", "content")):
                text = getattr(update, field)
                if text.startswith(sent[field]) and len(text) > len(sent[field]):
                    delta[key] = text[len(sent[field]):]
                    sent[field] = text
            if delta:
                yield chunk(delta)
            if update.done and update.stats.finish_reason == "error":
                # A model server that failed mid-reply: reported in band, as other failures.
                error = ApiError(502, update.notice, kind="backend_error")
                yield f"data: {json.dumps(error.body(), ensure_ascii=False)}\n\n"
                return  # no [DONE]: the reply did not complete
            if update.done:
                yield chunk({}, _FINISH.get(update.stats.finish_reason, "stop"))
                if call.include_usage:
                    data = {"id": call.id, "object": "chat.completion.chunk",
                            "created": call.created, "model": model, "choices": [],
                            "usage": usage(update.stats)}
                    yield f"data: {json.dumps(data)}\n\n"
                break
        yield "data: [DONE]\n\n"
    except Exception as error:  # noqa: BLE001 - the stream has started: report in band
        yield f"data: {json.dumps(failure(error).body())}\n\n"
    finally:
        call.stop.set()
        paced_updates.close()
        updates.close()  # ends engine.chat even if the stream never started (logs the reply)


def _prepend(first: ChatUpdate, updates: Iterator[ChatUpdate]) -> Iterator[ChatUpdate]:
    try:
        yield first
        yield from updates
    finally:
        updates.close()
