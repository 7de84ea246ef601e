"""RemoteEngine: the engine surface (backends.ChatBackend) served by an OpenAI-compatible
model server elsewhere: vLLM, SGLang, TGI, Ollama, Ray Serve, or another instance of this app.

Nothing is loaded here. Models, modes, placements and GPU memory are the server's business, so
load/unload/estimate say so; the model list comes from its /models (checked periodically, see
health.py); each reply streams through its /chat/completions with the user's settings, and
ends (closing the connection, so that the server frees the slot) on Stop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

from model_utils.bench.gate import bench_share
from model_utils.chat.budget import PromptBudget, estimate_prompt
from model_utils.chat.prompt import normalize_messages
from model_utils.chat.reasoning import EMPTY_TEXT, ReplyText, SeparatedReasoning
from model_utils.chat.updates import ChatUpdate, TokenLogprob
from model_utils.errors import ChatInputError, LoadError
from model_utils.memory import MemoryHistory, MemorySnapshot
from model_utils.runtime.generation_settings import GenerationSettings
from model_utils.runtime.grammar import OutputFormat
from model_utils.runtime.reply_stats import ReplyStats

from . import openai_client as api
from .errors import EXTENSIONS, BackendBusy, BackendError, BackendRejected, BackendUnavailable
from .health import HealthMonitor
from .model_entry import context_of, shown_name
from .server_defaults import reported_defaults
from .wire_extras import StreamedCalls, format_options, token_logprobs, wire_message

log = logging.getLogger(__name__)

NOT_HERE = ("this app is the front end of the model server at {url}: models, modes and "
            "placements are chosen there (restart that server to change them)")
_FINISH = {"stop": "eos", "length": "length", "tool_calls": "eos"}  # OpenAI finish_reason -> ReplyStats
UNBOUNDED_CONTEXT = 1 << 20  # max_tokens bound when the server does not say its context
# What one reply may bring (reasoning and answer together), whatever its token count: a reply
# of 32k tokens is ~130k characters. Past it the reply is cut, as past max_tokens.
MAX_REPLY_CHARS = 1 << 22


class RemoteEngine:
    """`model`: which of the server's models replies (default: the first it lists)."""

    def __init__(self, config: api.ServerConfig, *, model: str | None = None,
                 max_batch: int = 8, max_queue: int = 64, log_prompts: bool = False,
                 health_interval_s: float = 10.0, health_retry_s: float = 3.0,
                 health_timeout_s: float = api.MODELS_TIMEOUT_S, start_health: bool = True):
        self.config = config
        self.url = config.shown_url
        self.wanted_model = model
        # Replies in flight to the server at once; one more is refused as busy.
        self.max_batch, self.max_queue = max_batch, max_queue
        self.log_prompts = log_prompts
        self.memory = MemoryHistory()  # this host's memory (the memory endpoint still answers)
        # Health and the model's defaults: new connections too, for answer_deadline's hang-up.
        self.client = api.make_client(config, connections=max_batch + max_queue + 2,
                                      keep_alive=False)
        # The replies' own: a new connection each, whose socket the header watch can cut.
        self.stream_client = api.make_client(config, connections=max_batch + max_queue + 2,
                                             keep_alive=False)
        self.health_timeout_s = health_timeout_s
        self.monitor = HealthMonitor(lambda: api.list_models(self.client, config,
                                                             health_timeout_s),
                                     name=self.url, interval_s=health_interval_s,
                                     retry_s=health_retry_s)
        self._lock = threading.Lock()
        self._in_flight = 0
        self._defaults: dict[str, dict] = {}  # model id -> the sampling defaults it reports
        # Extensions the server refused once: left out of later requests, with a notice.
        self.refused: set[str] = set()
        if start_health:
            self.monitor.check_now()  # the first status already says up or down
            self.monitor.start()

    def bench_places(self) -> int:
        """The most places the Benchmark's streams take together (the local engine's rule)."""
        return bench_share(self.max_batch + self.max_queue)

    def close(self) -> None:
        self.monitor.close()
        self.client.close()
        self.stream_client.close()

    # -- what serves ----------------------------------------------------------------------------
    def _model_entry(self, models: tuple[dict, ...]) -> dict | None:
        if self.wanted_model:
            return next((m for m in models if m["id"] == self.wanted_model), None)
        return models[0] if models else None

    def status(self) -> dict:
        health = self.monitor.health
        entry = self._model_entry(health.models)
        model_id = entry["id"] if entry else (self.wanted_model or "")
        status = {
            "loaded": health.ok and entry is not None,
            "remote": True,
            "backend_url": self.url,
            # As this app's /v1/models names it (a path the server lists: its last part).
            "model": shown_name(model_id),
            "models": [shown_name(m["id"]) for m in health.models],
            "mode": "remote",
            "placement": self.url,
            "is_demo": False,
            "context_tokens": context_of(entry),
            # The sampling defaults the server reports for it (None: not asked yet, {}:
            # none reported, so the sliders' values are this app's).
            "server_defaults": self._defaults.get(model_id),
            "decode_path": "remote",
            "health": health.as_dict(),
            "refused_extensions": sorted(self.refused),
        }
        if health.ok and entry is None:
            status["health"]["error"] = (
                f"the model server does not serve {self.wanted_model!r}; it serves "
                f"{', '.join(status['models']) or 'no models'}")
        return status

    def status_version(self) -> int:
        """Changes when what status() says of the server changes (up or down, its models, an
        extension refused), so every open page redraws within its poll."""
        health = self.monitor.health
        return hash((health.ok, health.since, tuple(m["id"] for m in health.models),
                     tuple(sorted(self.refused))))

    def start_memory_sampler(self, interval_s: float = 2.0) -> None:
        """This host's memory, one history for every page (as the local engine keeps)."""
        self.memory.start_sampling(interval_s)

    def queue_status(self) -> dict:
        """Replies this app has in flight to the server (its own queue is the server's)."""
        with self._lock:
            return {"active": self._in_flight, "waiting": 0, "max_batch": self.max_batch,
                    "max_queue": self.max_queue}

    def memory_snapshot(self) -> MemorySnapshot:
        return replace(self.memory.record(), note=(
            f"the model runs on the model server ({self.url}): its GPU memory is the "
            "server's business. These figures are this front end's host."))

    def supports_thinking(self) -> bool:
        # The switch is passed on as chat_template_kwargs.enable_thinking; templates without
        # it ignore the value. Hidden once the server refused that field.
        return "chat_template_kwargs" not in self.refused

    def default_settings(self) -> GenerationSettings:
        """The sampling defaults the server reports for its model (asked once per model),
        the rest None: the server applies its own to what is not sent."""
        entry = self._model_entry(self.monitor.health.models)
        if entry is None:
            return GenerationSettings()
        if entry["id"] not in self._defaults:
            found = reported_defaults(self.client, self.config.base_url, entry,
                                      self.health_timeout_s)
            self._defaults[entry["id"]] = found
            log.info("model server %s: %s's sampling defaults %s", self.url,
                     shown_name(entry["id"]), found or "not reported")
        return GenerationSettings(**self._defaults[entry["id"]])

    def count_prompt(self, messages: list[dict], settings: GenerationSettings | None = None,
                     *, system_prompt: str | None = None, thinking: bool = True) -> PromptBudget:
        """An estimate from the characters: the model's tokenizer is the server's. The
        context is what the server says (max_model_len), or not known."""
        entry = self._model_entry(self.monitor.health.models)
        context = (entry or {}).get("max_model_len")
        return estimate_prompt(messages, settings or GenerationSettings(),
                               context_tokens=int(context) if context else None,
                               system_prompt=system_prompt)

    # -- what cannot be done here ---------------------------------------------------------------
    def load(self, request, progress=None) -> dict:
        raise LoadError(NOT_HERE.format(url="its model server"))

    def unload(self) -> dict:
        raise LoadError(NOT_HERE.format(url="its model server"))

    def estimate(self, request):
        raise LoadError(NOT_HERE.format(url="its model server"))

    # -- chat -----------------------------------------------------------------------------------
    def _current_model(self) -> tuple[str, int]:
        """(model id, context tokens) to send to; asks the server when no check has yet
        found it up (down at start, say), so a reply does not wait for the next check."""
        health = self.monitor.health
        entry = self._model_entry(health.models)
        if entry is None:
            health = self.monitor.check_now()
            if not health.ok:
                raise BackendUnavailable(f"the model server is not reachable: {health.error}")
            entry = self._model_entry(health.models)
            if entry is None:
                raise BackendError(self.status()["health"]["error"] or
                                   "the model server serves no models", http_status=503)
        return entry["id"], context_of(entry) or UNBOUNDED_CONTEXT

    def chat(self, messages: list[dict], settings: GenerationSettings | None = None, *,
             system_prompt: str | None = None, thinking: bool = True,
             stop: threading.Event | None = None,
             output_format: OutputFormat | None = None,
             logprobs: int | None = None) -> Iterator[ChatUpdate]:
        """Stream one reply from the server. Refusals before the first token raise (a
        BackendError with the HTTP status to answer); a failure after it ends the reply with
        a notice (finish_reason "error"), keeping what arrived. `output_format` (tools, a
        tool choice, a response format) is sent on as the server's own fields; the tool calls
        it returns come back in the answer as <tool_call> blocks, as a local model writes
        them, for the caller to read the same way."""
        stop = stop or threading.Event()
        settings = settings or GenerationSettings()
        wire = [wire_message(m) for m in normalize_messages(messages, system_prompt)]
        if not wire or wire[-1]["role"] not in ("user", "tool"):
            raise ChatInputError("the conversation must end with a user message")
        model, context = self._current_model()
        settings.check_given()  # the local engine's checks; unset values are the server's
        options = {**_options(settings), **format_options(output_format)}
        if logprobs is not None:
            options.update(logprobs=True, top_logprobs=logprobs)
        with self._lock:
            if self._in_flight >= self.max_batch + self.max_queue:
                raise BackendBusy(f"{self._in_flight} replies are already in flight to the "
                                  "model server: try again shortly", retry_after="1",
                                  http_status=503)
            self._in_flight += 1
        stats = ReplyStats(decode_path="remote")
        # Counted here too: a server that goes on past max_tokens (or past the context when
        # none is given) is cut off at that many pieces (one per token from vLLM and SGLang).
        budget = int(options.get("max_tokens") or context)
        try:
            yield from self._reply(model, wire, options, thinking, stop, stats, budget)
        finally:
            stop.set()
            with self._lock:
                self._in_flight -= 1
            log.info("reply: model=%s via %s, %d in / %d out, ttft %.1f ms, %.2f tok/s, "
                     "finish=%s", model, self.url, stats.prompt_tokens, stats.new_tokens,
                     stats.ttft_ms, stats.tok_s, stats.finish_reason or "abandoned")

    def _reply(self, model, wire, options, thinking, stop, stats,
               budget: int) -> Iterator[ChatUpdate]:
        start = time.perf_counter()
        deadline = time.monotonic() + self.config.reply_timeout_s
        notice = self._refused_notice(options)
        split, reply, text = SeparatedReasoning(), ReplyText(), EMPTY_TEXT
        first_at = last_at = None
        pieces, received, finish, usage = 0, 0, "", None
        calls = StreamedCalls()
        held_logprobs: list[TokenLogprob] = []  # the server's, not given out yet
        chunks = self._chunks(model, wire, options, thinking, stop, deadline)
        cut = ""  # why the reply was cut here, past its bounds
        try:
            for event in chunks:
                if isinstance(event, str):  # the notice of a retry without the extensions
                    notice = event
                    continue
                if isinstance(event.get("usage"), dict):
                    usage = event["usage"]
                for choice in _dicts(event.get("choices")):
                    delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
                    # vLLM and SGLang send Qwen3's thinking as reasoning_content (newer vLLM
                    # as reasoning); a server that does not parse it leaves <think> in content.
                    more = _text(delta.get("reasoning_content")) or _text(delta.get("reasoning"))
                    piece = _text(delta.get("content"))
                    calls.add(delta.get("tool_calls"))
                    held_logprobs += token_logprobs(choice.get("logprobs"))
                    finish = _text(choice.get("finish_reason")) or finish
                    if finish == "tool_calls":
                        piece += calls.as_text()
                    if more or piece:
                        received += len(more) + len(piece)
                        if pieces >= budget or received > MAX_REPLY_CHARS:
                            finish, cut = "length", _overflow(pieces, budget)
                            break
                        last_at = time.perf_counter()
                        if first_at is None:
                            first_at = last_at
                            stats.ttft_ms = (first_at - start) * 1000
                            if not self.monitor.health.ok:  # back before the check saw it
                                self.monitor.record(ok=True)
                        pieces += 1
                        added = split.feed(more, piece)
                        if added:
                            text = reply.add(added)
                            yield ChatUpdate.of(added, text, notice=notice,
                                                logprobs=held_logprobs)
                            held_logprobs = []
                if cut:
                    break
        except BackendError as error:
            if first_at is None:
                raise  # nothing shown yet: the caller answers with the error itself
            log.warning("reply from %s cut short: %s", self.url, error)
            finish = "error"
            notice = _join(notice, f"The reply was cut short: {error}.")
            if isinstance(error, BackendUnavailable):
                self.monitor.record(ok=False, error=str(error))
        finally:
            chunks.close()  # closes the connection: the server ends the reply and frees it
        if cut:
            log.warning("reply from %s cut here: %s", self.url, cut)
            notice = _join(notice, f"The reply was cut here: {cut}.")
        if not finish and not stop.is_set():
            finish = "error"
            notice = _join(notice, "The model server ended the reply without finishing it.")
        if calls.pending:  # calls the server ended without "tool_calls": still the reply's
            added = split.feed("", calls.as_text())
            text = reply.add(added)
            yield ChatUpdate.of(added, text, notice=notice)
        stats.stopped = stop.is_set() and finish != "error" and not _FINISH.get(finish)
        stats.finish_reason = "stop" if stats.stopped else _FINISH.get(finish, finish)
        stats.prompt_tokens = int((usage or {}).get("prompt_tokens") or 0)
        details = (usage or {}).get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        stats.cached_tokens = cached if isinstance(cached, int) and cached >= 0 else 0
        # The server's count when it sent one (not for a stopped reply: the connection closed
        # first); else the pieces received, one per token from vLLM and SGLang.
        stats.new_tokens = int((usage or {}).get("completion_tokens") or pieces)
        if first_at is not None and last_at > first_at:
            stats.tok_s = max(stats.new_tokens - 1, 1) / (last_at - first_at)
        stats.total_s = time.perf_counter() - start
        last = split.finish()
        text = reply.add(last)
        if self.log_prompts:
            log.info("reply text: reasoning %r, answer %r", text.reasoning, text.answer)
        yield ChatUpdate.of(last, text, done=True, stats=stats, notice=notice,
                            logprobs=held_logprobs)

    def _chunks(self, model, wire, options, thinking, stop, deadline):
        """The server's events. A 400 naming extensions it was sent is retried once without
        them (a str is yielded first: the notice to show); they are not sent again."""
        if self.log_prompts:
            log.info("prompt to %s: %r", self.url, wire)
        leave_out = set(self.refused)
        for attempt in (1, 2):
            body = api.request_body(model, wire, options, thinking, leave_out=leave_out)
            try:
                yield from api.stream_chunks(self.stream_client, self.config, body, stop,
                                             deadline)
                return
            except BackendRejected as error:
                named = set(error.extensions) & (set(body) & set(EXTENSIONS))
                if attempt == 2 or not named:
                    raise
                log.warning("model server %s refused %s: retrying without (%s)", self.url,
                            ", ".join(sorted(named)), error)
                self.refused |= named
                leave_out |= named
                yield self._refused_notice(options)
            except BackendUnavailable as error:
                self.monitor.record(ok=False, error=str(error))
                raise

    def _refused_notice(self, options: dict) -> str:
        dropped = sorted(self.refused & {*options, "chat_template_kwargs"})
        if not dropped:
            return ""
        names = ", ".join("enable_thinking" if d == "chat_template_kwargs" else d
                          for d in dropped)
        return f"The model server does not take {names}: sent without."

    def generate_text(self, messages: list[dict], settings: GenerationSettings | None = None,
                      **kwargs) -> ChatUpdate:
        final = None
        for final in self.chat(messages, settings, **kwargs):
            pass
        return final


def _options(settings: GenerationSettings) -> dict:
    """The settings the user gave, by their OpenAI names; unset ones are the server's."""
    out = {"max_tokens": settings.max_new_tokens, "temperature": settings.temperature,
           "top_p": settings.top_p, "seed": settings.seed}
    if settings.top_k:  # 0 = off: nothing to ask for
        out["top_k"] = settings.top_k
    if settings.repetition_penalty not in (None, 1.0):
        out["repetition_penalty"] = settings.repetition_penalty
    return {k: v for k, v in out.items() if v is not None}


def _dicts(value) -> list[dict]:
    """A list's dict entries (a server's "choices"); anything else is not read."""
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _text(value) -> str:
    return value if isinstance(value, str) else ""


def _overflow(pieces: int, budget: int) -> str:
    if pieces >= budget:
        return f"the model server went on past max_tokens ({budget})"
    return f"the model server sent more than {MAX_REPLY_CHARS:,} characters"


def _join(*notices: str) -> str:
    return " ".join(n for n in notices if n)
