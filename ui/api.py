"""Named endpoints for scripts (gradio_client): /chat, /load_model, /unload_model, /status,
/memory. Typed functions registered with gr.api, so the client sees plain JSON parameters
rather than the page's widgets. Errors are raised as gr.Error: the client gets an error status
with the message.

    from gradio_client import Client
    client = Client("http://127.0.0.1:7860")
    for update in client.submit("Hello", [], {"max_new_tokens": 64}, api_name="/chat"):
        print(update["answer"])
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import gradio as gr

from model_utils.engine import Engine

from . import model_actions as actions
from .common import reply_concurrency, user_error
from .conversation import ConversationError, validate_history
from .replies import make_settings, stats_line, stream

log = logging.getLogger("ui")


def register_api(engine: Engine, *, admin: str | None = None) -> None:
    """Call inside the gr.Blocks context."""

    def chat(message: str, history: list[dict] | None = None, settings: dict | None = None,
             system_prompt: str = "", thinking: bool = True,
             request: gr.Request = None) -> Iterator[dict]:
        """Stream a reply to `message` after `history` ([{role, content}, ...]).
        settings: any of temperature, top_p, top_k, max_new_tokens, repetition_penalty, seed
        (missing = the model's default). Yields {reasoning, answer, done, stats, notice};
        the last one has done=True and stats (ttft_ms, tok_s, prompt/new tokens, line)."""
        if not isinstance(message, str) or not message.strip():
            raise user_error("message is empty")
        try:
            turns = validate_history(history)
        except ConversationError as error:
            raise user_error(str(error)) from error
        if settings is not None and not isinstance(settings, dict):
            raise user_error("settings must be a JSON object, e.g. {\"max_new_tokens\": 64}")
        generation = make_settings(settings)
        mode = engine.status().get("mode", "?")
        messages = [*turns, {"role": "user", "content": message}]
        log.info("api chat: %d earlier messages, new message of %d chars, settings %s",
                 len(turns), len(message), settings or {})
        # No Stop button here: a client's job.cancel() (or a dropped connection) closes this
        # generator, and stream() sets the event and closes the engine's.
        for update in stream(engine, messages, generation, system_prompt=system_prompt,
                             thinking=thinking, stop=threading.Event()):
            stats = None
            if update.stats is not None:
                stats = {**update.stats.as_dict(), "line": stats_line(update.stats, mode)}
            yield {"reasoning": update.reasoning, "answer": update.answer, "done": update.done,
                   "stats": stats, "notice": update.notice}

    def load_model(model: str = "demo", mode: str = "bf16", placement: str | None = None,
                   max_memory_gb: dict | None = None, offload_folder: str | None = None,
                   compute_dtype: str = "bf16", context_tokens: int | None = None,
                   request: gr.Request = None) -> dict:
        """Load or switch to a model (a registry name, an allowed folder, or a cached hub id).
        placement: cpu, cuda:N, auto, balanced, balanced_low_0, sequential (None = auto on a
        GPU machine, else cpu). max_memory_gb: {"cuda:0": 20, "cpu": 64}. Returns the status.
        On failure the previous model is serving again and the error says why."""
        load_request = actions.make_request(
            model=model, mode=mode, placement=placement, max_memory_gb=max_memory_gb,
            offload_folder=offload_folder, compute_dtype=compute_dtype,
            context_tokens=context_tokens)
        return for_client(actions.load(engine, load_request, admin=admin, who=request))

    def unload_model(request: gr.Request = None) -> dict:
        """Unload the model; the status then has 'unloaded' with the memory not given back."""
        return for_client(actions.unload(engine, admin=admin, who=request))

    def status() -> dict:
        """What is loaded: model, mode, placement, device_map, footprint_gb, load_s, ...,
        and queue: {active, waiting, max_batch, max_queue} (None without a model)."""
        return {**for_client(engine.status()), "supports_thinking": engine.supports_thinking(),
                "queue": engine.queue_status()}

    def memory() -> dict:
        """A memory snapshot now: gpus (NVML used/total, torch allocated/reserved), cpu_used_gb,
        cpu_total_gb, process_rss_gb, note, and the loaded model's weights and caches (model)."""
        current = engine.status()
        model = {k: current.get(k) for k in ("loaded", "model", "mode", "footprint_gb",
                                             "kv_cache_gb", "device_map")}
        return {**engine.memory_snapshot().as_dict(), "model": model}

    gr.api(chat, api_name="chat", concurrency_id="reply", concurrency_limit=reply_concurrency(engine))
    gr.api(load_model, api_name="load_model", concurrency_id="model", concurrency_limit=1)
    gr.api(unload_model, api_name="unload_model", concurrency_id="model", concurrency_limit=1)
    gr.api(status, api_name="status", concurrency_limit=None)
    gr.api(memory, api_name="memory", concurrency_limit=None)


def for_client(status: dict) -> dict:
    """engine.status() for gradio_client: its "path" key becomes "model_path", because the
    client takes any dict with a "path" key for a file to download (and fails on a folder)."""
    out = dict(status)
    if "path" in out:
        out["model_path"] = out.pop("path")
    return out
