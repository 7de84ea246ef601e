"""The engine: the public face of model_utils for the UI, the CLI and the benchmark.

It owns the registry, the model manager and the memory history, and turns a conversation into a
stream of ChatUpdates. Nothing here knows about Gradio.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch

from model_utils.loading.load_stages import Progress
from model_utils.loading.loaded_model import LoadedModel, LoadRequest
from model_utils.runtime.generation_settings import GenerationSettings
from model_utils.runtime.reply_stats import ReplyStats

from . import process_tuning
from .chat.budget import PromptBudget, measure_prompt
from .chat.prompt import render_prompt, supports_thinking
from .chat.reasoning import prompt_opens_thinking
from .chat.reply_stream import prepare_reply, reply_updates
from .chat.updates import ChatUpdate, TokenLogprob
from .engine_config import EngineConfig
from .errors import NO_MODEL, LoadError, ShuttingDown
from .loading.manager import ModelManager
from .loading.placement import FitEstimate
from .loading.registry import ModelRegistry
from .memory import MemoryHistory, MemorySnapshot
from .runtime.decoders import EagerDecoder
from .runtime.generation import LogprobRecord, decode_tokens
from .runtime.grammar import Constraint, Grammars, OutputFormat, reasoning_mode
from .runtime.preparation import DecodePreparation
from .runtime.serving import Serving
from .runtime.worker import DecodeWorker

log = logging.getLogger(__name__)




def eos_ids(loaded: LoadedModel) -> set[int]:
    ids = loaded.model.generation_config.eos_token_id
    ids = ids if isinstance(ids, list) else [ids]
    ids = {i for i in ids if i is not None}
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(loaded.tokenizer.eos_token_id)
    return ids


class Engine:
    def __init__(self, config: EngineConfig | None = None, *, cache_dir: Path | None = None,
                 busy_timeout_s: float = 30.0, **options):
        """`config` whole, or its fields as keywords (`Engine(max_batch=4)`, for a library
        user or a test): an option EngineConfig does not declare is refused (TypeError)."""
        if config is None:
            config = EngineConfig(**options)
        elif options:
            config = replace(config, **options)
        if config.tp != 1:
            raise ValueError("Engine runs in this process; tp > 1 is "
                             "engine_factory.build_engine's tensor-parallel engine")
        self.config = config
        self.registry = ModelRegistry(config.models_dir, cache_dir=cache_dir)
        self.manager = ModelManager(self.registry, trust_remote_code=config.trust_remote_code,
                                    busy_timeout_s=busy_timeout_s, park_gb=config.park_gb)
        self.memory = MemoryHistory()
        # Bumped by every load, unload and switch (and a failed one, which may have put the
        # previous model back): pages poll this number and fetch status() only when it moved.
        self._status_version = 0
        self._version_lock = threading.Lock()
        # Every forward pass (warm-up and replies) runs on this one thread.
        self.worker = DecodeWorker()
        self._prepare_decoding = DecodePreparation(config, self.worker, self._status_changed)
        self.manager.on_loaded = self._on_loaded
        self.manager.on_unloaded = self._forget_compiled
        self.manager.held_beside = lambda: self._serving.held_gb() if self._serving else {}
        # How the loaded model is served (set after each load, dropped with its unload).
        self._serving: Serving | None = None
        # Shutting down (stop_admitting, end_replies): the stop events of open replies.
        self._open: set[threading.Event] = set()
        self._open_lock = threading.Lock()
        self._grammar_cache: tuple[LoadedModel, Grammars] | None = None
        # The unloaded model's grammar compiler, between a switch's unload and its load: a
        # mode switch keeps the tokenizer, and the compiler made from it (xgrammar's view of
        # the vocabulary took 1.9 s for 152 064 tokens on a 2-core CPU) goes on with it.
        self._kept_grammars: Grammars | None = None
        self._closing: str | None = None  # why new replies are refused
        self._ending: str | None = None  # why open replies were ended

    @property
    def max_batch(self) -> int:
        """Replies decoded together (the server layer reads it from every kind of engine)."""
        return self.config.max_batch

    @property
    def max_queue(self) -> int:
        return self.config.max_queue

    def start_memory_sampler(self, interval_s: float = 2.0) -> None:
        """One background thread records memory for every page and client (idempotent)."""
        self.memory.start_sampling(interval_s)

    def status_version(self) -> int:
        """A number that changes whenever status() may have changed model (cheap to poll)."""
        return self._status_version

    def _status_changed(self) -> None:
        with self._version_lock:
            self._status_version += 1

    @property
    def serving(self) -> Serving | None:
        """How the loaded model is served: its decode path, batch scheduler and runner."""
        return self._serving

    def _serving_of(self, loaded: LoadedModel) -> Serving:
        serving = self._serving
        assert serving is not None and serving.loaded is loaded, "serving another model"
        return serving

    def _on_loaded(self, loaded: LoadedModel, progress: Progress) -> None:
        self._serving = self._prepare_decoding(loaded, progress)
        kept, self._kept_grammars = self._kept_grammars, None
        if kept is not None and kept.fits(loaded.tokenizer, _vocab_size(loaded), eos_ids(loaded)):
            self._grammar_cache = (loaded, kept)
        process_tuning.model_loaded()  # the new model's objects out of the GC's full passes

    def _forget_compiled(self) -> None:
        self._status_changed()  # the model is gone (mid-switch too): pages may say so
        # The cache holds the unloaded model; its compiler only the tokenizer, which the next
        # load may keep (a plain unload, or a load that ends with none, drops it: load/unload).
        if self._grammar_cache is not None:
            self._kept_grammars = self._grammar_cache[1]
        self._grammar_cache = None
        if self._serving is not None:
            self._serving.close()  # no more graphs captured for it while idle
        self._serving = None  # its scheduler, runner and KV cache go with it
        # Wait for the decode loop to let go of the unloaded model's batch cache.
        self.worker.call(lambda: None)
        if torch.cuda.is_available():
            # The compiled code stays for a later load of the same kind (runtime/compiled_code.py);
            # the captured graphs and their memory pool went with the serving.
            # cuBLAS keeps a workspace for every stream it ran on until told otherwise: the
            # graphs' warm-up stream is new with each load, and the capture's workspace sits
            # in the unloaded graphs' pool. Left alone, every load kept a workspace more
            # (BENCHMARKS.md, "Switching modes"). Nothing replays once the serving is gone, so
            # dropping them is safe; the next model's first call makes one.
            self.worker.call(torch._C._cuda_clearCublasWorkspaces)

    # -- models -------------------------------------------------------------------------------
    def load(self, request: LoadRequest, progress: Progress | None = None) -> dict:
        before = weakref.ref(self._serving) if self._serving else None  # not kept alive here
        self._stop_idle_work()
        try:
            self.manager.load(request, progress)
        finally:
            self._kept_grammars = None  # taken by the load, or nothing is loaded to take it
            self._status_changed()
            # Refused: the model serves on. No local holds a serving (the raised error's
            # frame would keep a replaced one alive).
            if before is not None and self._serving is not None and before() is self._serving:
                self._serving.resume_idle_work()
        return self.status()

    def unload(self) -> dict:
        self._stop_idle_work()
        try:
            report = self.manager.unload()
        finally:
            self._kept_grammars = None  # no load follows: the tokenizer goes with the model
            self._status_changed()
        status = self.status()
        if report:
            status["unloaded"] = report.as_dict()
        return status

    def queue_status(self) -> dict | None:
        """{active, waiting, max_batch, max_queue} of the loaded model's batch, or None."""
        serving = self._serving
        return serving.queue_status() if serving is not None else None

    def estimate(self, request: LoadRequest) -> FitEstimate:
        with self.worker.idle_lock:  # it asks CUDA for free memory: not during a capture
            return self.manager.estimate(request)

    def _stop_idle_work(self) -> None:
        """Before a load or unload touches the GPU from this thread (free memory, host
        buffers): the work the load before left for idle time stops, and its step under way,
        if any, ends first (DecodeWorker.post_while_idle). What it did not capture is captured
        when a prompt needs it."""
        if self._serving is not None:
            self._serving.closed.set()
        with self.worker.idle_lock:
            pass

    def status(self) -> dict:
        status = self.manager.status()
        serving = self._serving
        if serving is not None and status.get("loaded"):
            status.update(serving.status())
        elif self.manager.last_unload is not None:  # what the last unload left behind
            status["last_unload"] = self.manager.last_unload.as_dict()
        return status

    def memory_snapshot(self) -> MemorySnapshot:
        return self.memory.record()

    # -- shutting down ------------------------------------------------------------------------
    def stop_admitting(self, reason: str) -> None:
        """Refuse every new reply from now on with ShuttingDown(reason); open ones go on."""
        self._closing = reason

    def open_replies(self) -> int:
        with self._open_lock:
            return len(self._open)

    def end_replies(self, reason: str) -> int:
        """End every open reply within a decode step: each one's stream raises
        ShuttingDown(reason) instead of finishing. Returns how many were open."""
        with self._open_lock:
            self._ending = reason
            open_now = list(self._open)
        for stop in open_now:
            stop.set()
        return len(open_now)

    # -- chat ---------------------------------------------------------------------------------
    def supports_thinking(self) -> bool:
        loaded = self.manager.loaded
        return bool(loaded) and supports_thinking(loaded.tokenizer)

    def default_settings(self) -> GenerationSettings:
        """The loaded model's recommended settings (its generation_config). A read: it does
        not hold the model, so a page opened during a switch gets them at once (the current
        model's) instead of waiting for the switch."""
        loaded = self.manager.loaded
        if loaded is None:
            raise LoadError(NO_MODEL)
        return GenerationSettings().resolved(loaded.model.generation_config,
                                             context_tokens=loaded.context_tokens)

    def render_prompt(self, messages: list[dict], *, system_prompt: str | None = None,
                      thinking: bool = True) -> str:
        with self.manager.use() as loaded:
            return render_prompt(loaded.tokenizer, messages, system_prompt=system_prompt,
                                 thinking=thinking)

    def count_prompt(self, messages: list[dict], settings: GenerationSettings | None = None,
                     *, system_prompt: str | None = None, thinking: bool = True) -> PromptBudget:
        """How much of the context these messages would take as a reply's prompt (trimmed as
        chat() would trim them). A read of the loaded tokenizer: no use of the model is held,
        so a count does not wait for replies or a switch."""
        loaded = self.manager.loaded
        if loaded is None:
            raise LoadError(NO_MODEL)
        settings = (settings or GenerationSettings()).resolved(
            loaded.model.generation_config, context_tokens=loaded.context_tokens)
        return measure_prompt(loaded.tokenizer, messages, settings,
                              context_tokens=loaded.context_tokens,
                              system_prompt=system_prompt, thinking=thinking)

    def chat(self, messages: list[dict], settings: GenerationSettings | None = None, *,
             system_prompt: str | None = None, thinking: bool = True,
             stop: threading.Event | None = None,
             output_format: OutputFormat | None = None,
             logprobs: int | None = None) -> Iterator[ChatUpdate]:
        """Stream one reply. Raises ChatInputError / InvalidParameter / LoadError on bad input
        before anything is generated; the model and the conversation are left as they were.
        `output_format`: tools the template describes to the model, and a format the reply
        must follow (JSON, a schema, a forced tool call: grammar.py). `logprobs`: each token's
        log-probability and this many alternatives in the updates (None: none)."""
        stop = stop or threading.Event()
        if self._closing is not None:
            raise ShuttingDown(self._closing)
        with self._open_lock:
            self._open.add(stop)
        try:
            yield from self._chat(messages, settings, system_prompt=system_prompt,
                                  thinking=thinking, stop=stop, output_format=output_format,
                                  logprobs=logprobs)
        finally:
            with self._open_lock:
                self._open.discard(stop)

    def _chat(self, messages: list[dict], settings: GenerationSettings | None, *,
              system_prompt: str | None, thinking: bool, stop: threading.Event,
              output_format: OutputFormat | None,
              logprobs: int | None) -> Iterator[ChatUpdate]:
        fmt = output_format or OutputFormat()
        record = LogprobRecord(logprobs) if logprobs is not None else None
        with self.manager.use() as loaded:
            settings = (settings or GenerationSettings()).resolved(
                loaded.model.generation_config, context_tokens=loaded.context_tokens)
            prompt, settings = prepare_reply(loaded.tokenizer, messages, settings,
                                             context_tokens=loaded.context_tokens,
                                             system_prompt=system_prompt, thinking=thinking,
                                             tools=fmt.rendered_tools)
            if self.config.log_prompts:
                log.info("prompt: %r", prompt.text)
            constraint, reasoning = None, "auto"
            if fmt.constrained:
                thinks = thinking and supports_thinking(loaded.tokenizer)
                reasoning = reasoning_mode(thinks, prompt_opens_thinking(prompt.text))
                constraint = self._grammars(loaded).constraint(fmt, reasoning)
            stats = ReplyStats()
            tokens = self._tokens(loaded, prompt.input_ids, settings, stop, stats, constraint,
                                  record)
            logprob_of = None
            if record is not None:
                logprob_of = token_logprobs(record, loaded.tokenizer, 0 if logprobs == 0
                                            else record.k)

            def before_end():
                if self._ending is not None and stats.stopped:
                    raise ShuttingDown(self._ending)

            update = None
            try:
                for update in reply_updates(tokens, loaded.tokenizer, prompt, stats,
                                            before_end=before_end,
                                            reasoning=reasoning != "disabled",
                                            logprob_of=logprob_of):
                    yield update
            finally:
                # Runs on normal end, on error and when the consumer goes away (closed tab):
                # whatever happened, the reply is logged and the decode slot is free again.
                stop.set()
                log.info("reply: model=%s mode=%s path=%s %d in / %d out, ttft %.0f ms, "
                         "%.1f tok/s, finish=%s", loaded.display_name, loaded.mode.name,
                         stats.decode_path, stats.prompt_tokens, stats.new_tokens,
                         stats.ttft_ms, stats.tok_s, stats.finish_reason or "abandoned")
                if self.config.log_prompts and update is not None:
                    log.info("reply text: reasoning %r, answer %r", update.reasoning,
                             update.answer)

    def _tokens(self, loaded: LoadedModel, input_ids: list[int], settings: GenerationSettings,
                stop: threading.Event, stats: ReplyStats,
                constraint: Constraint | None = None,
                record: LogprobRecord | None = None) -> Iterator[int]:
        """The reply's token ids: from the batch scheduler, or (a model it cannot batch) from
        the single-stream decoder, one reply at a time. Raises QueueFull when too busy."""
        scheduler = self._serving_of(loaded).scheduler
        if scheduler is not None:
            lists = {} if record is None else {"logprobs": record.top, "logprob_k": record.k,
                                               "chosen": record.chosen}
            return scheduler.submit(input_ids, settings, eos_ids=eos_ids(loaded),
                                         stop=stop, stats=stats, constraint=constraint,
                                         **lists)

        def produce():  # runs on the decode worker
            if not stop.is_set():
                yield from decode_tokens(self.decoder_for(loaded), input_ids, settings,
                                         eos_ids=eos_ids(loaded), stop=stop, stats=stats,
                                         constraint=constraint, record=record)

        return self.worker.stream(produce)

    def _grammars(self, loaded: LoadedModel) -> Grammars:
        """The grammar compiler of the loaded model's tokenizer (made at its first use)."""
        with self._open_lock:
            if self._grammar_cache is None or self._grammar_cache[0] is not loaded:
                self._grammar_cache = (loaded, Grammars(loaded.tokenizer, _vocab_size(loaded),
                                                        eos_ids(loaded)))
            return self._grammar_cache[1]

    @staticmethod
    def decoder_for(loaded: LoadedModel) -> EagerDecoder:
        return EagerDecoder(loaded.model)

    def generate_text(self, messages: list[dict], settings: GenerationSettings | None = None,
                      **kwargs) -> ChatUpdate:
        """The whole reply at once (CLI, tests)."""
        final = None
        for final in self.chat(messages, settings, **kwargs):
            pass
        return final


def _vocab_size(loaded: LoadedModel) -> int:
    return loaded.model.config.get_text_config().vocab_size


def token_logprobs(record: LogprobRecord, tokenizer, alternatives: int):
    """logprob_of(i, token) for reply_updates: the i-th token's TokenLogprob from `record`,
    each token's text as the tokenizer decodes it alone."""
    def text(token_id: int) -> str:
        return tokenizer.decode([token_id])

    def logprob_of(i: int, token: int) -> TokenLogprob:
        chosen, top = record.entry(i)
        return TokenLogprob(text(token), chosen,
                            tuple((text(t), lp) for t, lp in top[:alternatives]))

    return logprob_of
