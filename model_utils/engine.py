"""The engine: the public face of model_utils for the UI, the CLI and the benchmark.

It owns the registry, the model manager and the memory history, and turns a conversation into a
stream of ChatUpdates. Nothing here knows about Gradio.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .chat import prepare_prompt, render_prompt, split_reasoning, supports_thinking
from . import fast_path
from .decoders import EagerDecoder
from .generation import GenerationSettings, IncrementalDetokenizer, ReplyStats, decode_tokens
from .manager import LoadedModel, LoadRequest, ModelManager, Progress
from .memory import MemoryHistory, MemorySnapshot
from .placement import FitEstimate
from .registry import ModelRegistry
from .worker import DecodeWorker

log = logging.getLogger(__name__)


@dataclass
class ChatUpdate:
    reasoning: str
    answer: str
    done: bool = False
    stats: ReplyStats | None = None
    notice: str = ""


def eos_ids(loaded: LoadedModel) -> set[int]:
    ids = loaded.model.generation_config.eos_token_id
    ids = ids if isinstance(ids, list) else [ids]
    ids = {i for i in ids if i is not None}
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(loaded.tokenizer.eos_token_id)
    return ids


class Engine:
    def __init__(self, *, models_dir: str | Path | None = None, cache_dir: Path | None = None,
                 trust_remote_code: bool = False, log_prompts: bool = False,
                 busy_timeout_s: float = 30.0, compile: bool = True,
                 compile_mode: str = "default"):
        self.registry = ModelRegistry(models_dir, cache_dir=cache_dir)
        self.manager = ModelManager(self.registry, trust_remote_code=trust_remote_code,
                                    busy_timeout_s=busy_timeout_s)
        self.memory = MemoryHistory()
        self.log_prompts = log_prompts
        self.compile = compile
        self.compile_mode = compile_mode  # torch.compile mode of the fast path's step
        # Every forward pass (warm-up and replies) runs on this one thread; replies take turns.
        self.worker = DecodeWorker()
        self.manager.on_loaded = self._prepare_decoding
        self.manager.on_unloaded = self._forget_compiled

    def _prepare_decoding(self, loaded: LoadedModel, progress: Progress) -> None:
        if not self.compile:
            loaded.decode_path_reason = "eager path: compilation turned off (--no-compile)"
            return
        self.worker.call(lambda: fast_path.attach(loaded, progress,
                                                  inductor_mode=self.compile_mode))

    def _forget_compiled(self) -> None:
        if torch.cuda.is_available():
            # Compiled graphs and their CUDA-graph memory pool hold GPU memory of their own.
            self.worker.call(torch._dynamo.reset)

    # -- models -------------------------------------------------------------------------------
    def load(self, request: LoadRequest, progress: Progress | None = None) -> dict:
        self.manager.load(request, progress)
        return self.status()

    def unload(self) -> dict:
        report = self.manager.unload()
        status = self.status()
        if report:
            status["unloaded"] = {"model": report.model, "leftover": report.leftover}
        return status

    def estimate(self, request: LoadRequest) -> FitEstimate:
        return self.manager.estimate(request)

    def status(self) -> dict:
        return self.manager.status()

    def memory_snapshot(self) -> MemorySnapshot:
        return self.memory.record()

    # -- chat ---------------------------------------------------------------------------------
    def supports_thinking(self) -> bool:
        loaded = self.manager.loaded
        return bool(loaded) and supports_thinking(loaded.tokenizer)

    def default_settings(self) -> GenerationSettings:
        with self.manager.use() as loaded:
            return GenerationSettings().resolved(loaded.model.generation_config,
                                                 context_tokens=loaded.context_tokens)

    def render_prompt(self, messages: list[dict], *, system_prompt: str | None = None,
                      thinking: bool = True) -> str:
        with self.manager.use() as loaded:
            return render_prompt(loaded.tokenizer, messages, system_prompt=system_prompt,
                                 thinking=thinking)

    def chat(self, messages: list[dict], settings: GenerationSettings | None = None, *,
             system_prompt: str | None = None, thinking: bool = True,
             stop: threading.Event | None = None) -> Iterator[ChatUpdate]:
        """Stream one reply. Raises ChatInputError / InvalidParameter / LoadError on bad input
        before anything is generated; the model and the conversation are left as they were."""
        stop = stop or threading.Event()
        with self.manager.use() as loaded:
            settings = (settings or GenerationSettings()).resolved(
                loaded.model.generation_config, context_tokens=loaded.context_tokens)
            prompt = prepare_prompt(loaded.tokenizer, messages,
                                    context_tokens=loaded.context_tokens,
                                    reserve_tokens=settings.max_new_tokens,
                                    system_prompt=system_prompt, thinking=thinking)
            if self.log_prompts:
                log.info("prompt: %r", prompt.text)
            stats = ReplyStats()
            text = ""

            def produce():  # runs on the decode worker
                if not stop.is_set():
                    yield from decode_tokens(self.decoder_for(loaded), prompt.input_ids,
                                             settings, eos_ids=eos_ids(loaded), stop=stop,
                                             stats=stats)

            detok = IncrementalDetokenizer(loaded.tokenizer)
            try:
                for token in self.worker.stream(produce):
                    piece = detok.push(token)
                    if piece:
                        text += piece
                        reasoning, answer = split_reasoning(text)
                        yield ChatUpdate(reasoning, answer, notice=prompt.notice)
            finally:
                # Runs on normal end, on error and when the consumer goes away (closed tab):
                # whatever happened, the reply is logged and the decode slot is free again.
                stop.set()
                log.info("reply: model=%s mode=%s path=%s %d in / %d out, ttft %.0f ms, "
                         "%.1f tok/s, finish=%s", loaded.display_name, loaded.mode.name,
                         stats.decode_path, stats.prompt_tokens, stats.new_tokens,
                         stats.ttft_ms, stats.tok_s, stats.finish_reason or "abandoned")
                if self.log_prompts:
                    log.info("reply text: %r", text)
            reasoning, answer = split_reasoning(text)
            yield ChatUpdate(reasoning, answer, done=True, stats=stats, notice=prompt.notice)

    @staticmethod
    def decoder_for(loaded: LoadedModel):
        if loaded.fast_path is not None:
            return loaded.fast_path.decoder()
        return EagerDecoder(loaded.model)

    def generate_text(self, messages: list[dict], settings: GenerationSettings | None = None,
                      **kwargs) -> ChatUpdate:
        """The whole reply at once (CLI, tests)."""
        final = None
        for final in self.chat(messages, settings, **kwargs):
            pass
        return final


def cuda_available() -> bool:
    return torch.cuda.is_available()
