"""Named endpoints for scripts (gradio_client): /chat, /count_tokens, /load_model,
/unload_model, /status, /memory. Typed functions registered with gr.api, so the client sees plain JSON parameters
rather than the page's widgets. Parameters are checked by pydantic (request_models), errors
are mapped once (errors.py) and raised as gr.Error with a plain message: the client gets an
error status with that text, never an exception's, and a guest never sees a server path.

    from gradio_client import Client
    client = Client("http://127.0.0.1:7860")
    for update in client.submit("Hello", [], {"max_new_tokens": 64}, api_name="/chat"):
        print(update["answer"])
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import gradio as gr

from . import context_budget
from . import model_actions as actions
from .common import reply_concurrency
from .conversation import validate_history
from .errors import api_error, models_dir_of, shows_full_paths, status_for
from .queue_gone import SESSIONS
from .replies import make_settings, paced, stats_line
from .request_models import ChatParams, CountParams, LoadParams

if TYPE_CHECKING:
    from model_utils.engine import Engine

log = logging.getLogger("ui")


def register_api(engine: Engine, *, admin: str | None = None) -> None:
    """Call inside the gr.Blocks context."""
    models_dir = models_dir_of(engine)

    def full_paths(request: gr.Request | None) -> bool:
        return shows_full_paths(admin, getattr(request, "username", None))

    def plain_errors(fn):
        """Any failure of `fn` -> a gr.Error with the mapped, plain message."""
        signature = inspect.signature(fn)

        @functools.wraps(fn)  # gradio reads the signature (and inserts the gr.Request) by it
        def endpoint(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 - mapped: input, busy, or a logged bug
                request = signature.bind_partial(*args, **kwargs).arguments.get("request")
                raise api_error(error, full_paths=full_paths(request), models_dir=models_dir,
                                context=fn.__name__) from None
        return endpoint

    def chat(message: str, history: list[dict] | None = None, settings: dict | None = None,
             system_prompt: str = "", thinking: bool = True,
             request: gr.Request = None) -> Iterator[dict]:
        """Stream a reply to `message` after `history` ([{role, content}, ...]).
        settings: any of temperature, top_p, top_k, max_new_tokens, repetition_penalty, seed
        (missing = the model's default). Yields {reasoning, answer, done, stats, notice};
        the last one has done=True and stats (ttft_ms, tok_s, prompt/new tokens, line)."""
        stop = threading.Event()
        updates = None
        try:
            params = ChatParams(message=message, history=history, settings=settings,
                                system_prompt=system_prompt, thinking=thinking)
            turns = validate_history(params.history)
            generation = make_settings(params.settings)
            mode = engine.status().get("mode", "?")
            messages = [*turns, {"role": "user", "content": params.message}]
            log.info("api chat: %d earlier messages, new message of %d chars, settings %s",
                     len(turns), len(params.message), params.settings or {})
            # No Stop button here: a client's job.cancel() closes this generator, which
            # sets the event and closes the engine's.
            updates = engine.chat(messages, generation, system_prompt=params.system_prompt
                                  or None, thinking=params.thinking, stop=stop)
            # A client that closes its event stream sets `stop` at once (queue_gone.py).
            with SESSIONS.watching(getattr(request, "session_hash", None), stop):
                for update in paced(updates):
                    stats = None
                    if update.stats is not None:
                        stats = {**update.stats.as_dict(),
                                 "line": stats_line(update.stats, mode)}
                    yield {"reasoning": update.reasoning, "answer": update.answer,
                           "done": update.done, "stats": stats, "notice": update.notice}
        except Exception as error:  # noqa: BLE001 - mapped: input, busy, or a logged bug
            raise api_error(error, full_paths=full_paths(request), models_dir=models_dir,
                            context="api chat") from None
        finally:
            stop.set()
            if updates is not None:
                updates.close()

    @plain_errors
    def count_tokens(message: str = "", history: list[dict] | None = None,
                     settings: dict | None = None, system_prompt: str = "",
                     thinking: bool = True, request: gr.Request = None) -> dict:
        """How much of the context `history` + `message` would take as the reply's prompt,
        counted by the loaded model's tokenizer through its chat template (the oldest turns
        left out as a reply would leave them out). Returns {prompt_tokens, context_tokens,
        reply_tokens (kept for the reply), dropped_messages, near_limit, estimated (no
        tokenizer here: characters / 4), error (why it could not be sent), line}."""
        params = CountParams(message=message, history=history, settings=settings,
                             system_prompt=system_prompt, thinking=thinking)
        budget = context_budget.count(engine, params.history, params.message, params.settings,
                                      system_prompt=params.system_prompt or "",
                                      thinking=params.thinking)
        return {**budget.as_dict(), "line": context_budget.budget_line(budget)}

    @plain_errors
    def load_model(model: str = "demo", mode: str = "bf16", placement: str | None = None,
                   max_memory_gb: dict | None = None, offload_folder: str | None = None,
                   compute_dtype: str = "bf16", context_tokens: int | None = None,
                   request: gr.Request = None) -> dict:
        """Load or switch to a model (a registry name, an allowed folder, or a cached hub id).
        placement: cpu, cuda:N, auto, balanced, balanced_low_0, sequential (None = auto on a
        GPU machine, else cpu). max_memory_gb: {"cuda:0": 20, "cpu": 64}. Returns the status.
        On failure the previous model is serving again and the error says why."""
        # The admin check comes before anything about the request is looked at.
        actions.require_admin(admin, request, "load or switch models")
        params = LoadParams(model=model, mode=mode, placement=placement,
                            max_memory_gb=max_memory_gb, offload_folder=offload_folder,
                            compute_dtype=compute_dtype, context_tokens=context_tokens)
        load_request = actions.make_request(**params.model_dump())
        return status_for(actions.load(engine, load_request, admin=admin, who=request),
                          full_paths=full_paths(request), models_dir=models_dir)

    @plain_errors
    def unload_model(request: gr.Request = None) -> dict:
        """Unload the model; the status then has 'unloaded' with the memory not given back."""
        return status_for(actions.unload(engine, admin=admin, who=request),
                          full_paths=full_paths(request), models_dir=models_dir)

    @plain_errors
    def status(request: gr.Request = None) -> dict:
        """What is loaded: model, mode, placement, device_map, footprint_gb, load_s, ...,
        and queue: {active, waiting, max_batch, max_queue} (None without a model).
        model_path is relative to the models folder for users other than the admin."""
        return {**status_for(engine.status(), full_paths=full_paths(request),
                             models_dir=models_dir),
                "supports_thinking": engine.supports_thinking(), "queue": engine.queue_status()}

    @plain_errors
    def memory(request: gr.Request = None) -> dict:
        """A memory snapshot now: gpus (NVML used/total, torch allocated/reserved), cpu_used_gb,
        cpu_total_gb, process_rss_gb, note, and the loaded model's weights and caches (model)."""
        current = engine.status()
        model = {k: current.get(k) for k in ("loaded", "model", "mode", "footprint_gb",
                                             "kv_cache_gb", "device_map")}
        return {**engine.memory_snapshot().as_dict(), "model": model}

    gr.api(chat, api_name="chat", concurrency_id="reply",
           concurrency_limit=reply_concurrency(engine))
    # Counting renders and tokenizes the conversation: a few at once, beside the replies.
    gr.api(count_tokens, api_name="count_tokens", concurrency_id="count", concurrency_limit=4)
    gr.api(load_model, api_name="load_model", concurrency_id="model", concurrency_limit=1)
    gr.api(unload_model, api_name="unload_model", concurrency_id="model", concurrency_limit=1)
    gr.api(status, api_name="status", concurrency_limit=None)
    gr.api(memory, api_name="memory", concurrency_limit=None)
