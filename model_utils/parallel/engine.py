"""TensorParallelEngine: the Engine's load / chat / status surface over N worker processes.

The prompt side is the single-process engine's own code (chat/prompt.py, the settings schema,
the detokenizer, the reasoning split); only where the tokens come from differs: a WorkerGroup
whose ranks each hold 1/N of the model. One reply at a time, on the eager decode path (no
batching, no compile, no CUDA graphs yet).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import fields, replace

from model_utils.runtime.generation_settings import GenerationSettings
from model_utils.runtime.reply_stats import ReplyStats

from ..chat.budget import PromptBudget, measure_prompt
from ..chat.prompt import render_prompt, supports_thinking
from ..chat.reply_stream import prepare_reply, reply_updates
from ..chat.updates import ChatUpdate
from ..engine_config import EngineConfig
from ..errors import InvalidParameter, LoadError
from ..loading import preflight
from ..loading.modes import get_mode
from ..loading.registry import ModelRegistry
from ..runtime.grammar import OutputFormat
from ..runtime.sampling import is_greedy
from .group import WorkerGroup

log = logging.getLogger(__name__)

# Modes whose weights are plain Linear layers the split can cut (quantized layers are not).
TP_MODES = ("fp32", "bf16", "fp16")
# EngineConfig's options of the batched, compiled path, which the workers do not have.
NOT_APPLIED = ("max_batch", "max_queue", "compile", "compile_mode", "compiled_rows",
               "compile_while_idle")


class TensorParallelEngine:
    def __init__(self, config: EngineConfig | int, *, cache_dir=None):
        """`config` whole (or, for a test, the number of workers). The batch and compile
        options do not apply here (one reply at a time on the eager path): a value other than
        the default is said in the log rather than taken silently."""
        config = EngineConfig(tp=config) if isinstance(config, int) else config
        if config.tp < 2:
            raise ValueError("tensor parallelism needs at least 2 workers")
        unused = [f"{f.name}={getattr(config, f.name)!r}" for f in fields(config)
                  if f.name in NOT_APPLIED and getattr(config, f.name) != f.default]
        if unused:
            log.warning("--tp %d decodes one reply at a time on the eager path: %s not applied",
                        config.tp, ", ".join(unused))
        self.config = config
        self.tp = config.tp
        self.registry = ModelRegistry(config.models_dir, cache_dir=cache_dir)
        self.trust_remote_code = config.trust_remote_code
        self.log_prompts = config.log_prompts
        self.group: WorkerGroup | None = None
        self.loaded: dict | None = None  # tokenizer, generation_config, status ...
        self._lock = threading.Lock()

    # -- models -------------------------------------------------------------------------------
    def load(self, request, progress=None) -> dict:
        from transformers import AutoTokenizer, GenerationConfig

        mode = get_mode(request.mode)
        if mode.name not in TP_MODES:
            raise LoadError(f"--tp {self.tp} runs {', '.join(TP_MODES)}; {mode.name} is not "
                            "split across workers yet")
        target = request.placement.target if request.placement else "cpu"
        if target not in ("cpu", "auto"):
            raise LoadError(f"--tp {self.tp} places the model itself (one GPU per worker, or "
                            f"the CPU); --placement {target} does not apply")
        source = self.registry.resolve(request.model)
        if source.adapter is not None:
            raise LoadError(f"--tp {self.tp} does not load adapters yet")
        preflight.require_safetensors(source)
        config = preflight.read_config(source, trust_remote_code=self.trust_remote_code)
        preflight.check_context(config, request.context_tokens)
        from .sharding import check_divisible

        check_divisible(config, self.tp)
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() < self.tp:
            raise LoadError(f"--tp {self.tp} needs {self.tp} GPUs, one per worker; "
                            f"{torch.cuda.device_count()} found")
        with self._lock:
            self.unload()
            start = time.perf_counter()
            tokenizer = AutoTokenizer.from_pretrained(
                source.path, trust_remote_code=self.trust_remote_code)
            try:
                generation_config = GenerationConfig.from_pretrained(source.path)
            except OSError:
                generation_config = GenerationConfig.from_model_config(config)
            self.group = WorkerGroup(self.tp, path=str(source.path),
                                     dtype_name=mode.weight_dtype,
                                     trust_remote_code=self.trust_remote_code)
            load_s = time.perf_counter() - start
            devices = [shard["device"] for shard in self.group.shards]
            self.loaded = {
                "tokenizer": tokenizer, "generation_config": generation_config,
                "context_tokens": preflight.context_tokens(config, request.context_tokens),
                "label": source.label, "path": str(source.path), "is_demo": source.is_demo,
                "mode": mode.name, "load_s": load_s,
                "shard_gb": [round(s["shard_bytes"] / 1e9, 4) for s in self.group.shards],
                "placement": f"tensor parallel over {self.tp} workers ({', '.join(devices)})",
            }
        log.info("loaded %s mode=%s over %d tensor-parallel workers in %.2f s",
                 source.label, mode.name, self.tp, load_s)
        return self.status()

    def unload(self) -> dict:
        group, self.group, self.loaded = self.group, None, None
        if group is not None:
            group.stop()
        return self.status()

    close = unload

    def status(self) -> dict:
        if self.loaded is None:
            return {"loaded": False, "tp": self.tp}
        info = self.loaded
        return {"loaded": True, "model": info["label"], "path": info["path"],
                "is_demo": info["is_demo"], "mode": info["mode"],
                "placement": info["placement"], "tp": self.tp,
                "shard_gb": info["shard_gb"], "load_s": round(info["load_s"], 3),
                "context_tokens": info["context_tokens"],
                "decode_path": f"tensor-parallel eager ({self.tp} workers)"}

    def _require(self) -> dict:
        if self.loaded is None or self.group is None:
            raise LoadError("no model is loaded")
        return self.loaded

    # -- chat ---------------------------------------------------------------------------------
    def supports_thinking(self) -> bool:
        return self.loaded is not None and supports_thinking(self.loaded["tokenizer"])

    def default_settings(self) -> GenerationSettings:
        info = self._require()
        return GenerationSettings().resolved(info["generation_config"],
                                             context_tokens=info["context_tokens"])

    def render_prompt(self, messages, *, system_prompt=None, thinking=True) -> str:
        return render_prompt(self._require()["tokenizer"], messages,
                             system_prompt=system_prompt, thinking=thinking)

    def count_prompt(self, messages, settings=None, *, system_prompt=None,
                     thinking=True) -> PromptBudget:
        info = self._require()
        settings = (settings or GenerationSettings()).resolved(
            info["generation_config"], context_tokens=info["context_tokens"])
        return measure_prompt(info["tokenizer"], messages, settings,
                              context_tokens=info["context_tokens"],
                              system_prompt=system_prompt, thinking=thinking)

    def _eos_ids(self, info: dict) -> set[int]:
        ids = info["generation_config"].eos_token_id
        ids = {i for i in (ids if isinstance(ids, list) else [ids]) if i is not None}
        if info["tokenizer"].eos_token_id is not None:
            ids.add(info["tokenizer"].eos_token_id)
        return ids

    def chat(self, messages: list[dict], settings: GenerationSettings | None = None, *,
             system_prompt: str | None = None, thinking: bool = True,
             stop: threading.Event | None = None,
             output_format: OutputFormat | None = None,
             logprobs: int | None = None) -> Iterator[ChatUpdate]:
        """Stream one reply, as Engine.chat does. A worker that dies ends it with WorkerLost
        and unloads the model (the others are stopped too). Tools are described to the model;
        a format it must follow is refused (the workers sample without constraints)."""
        stop = stop or threading.Event()
        fmt = output_format or OutputFormat()
        if logprobs is not None:
            raise InvalidParameter("logprobs", "not supported with --tp")
        if fmt.constrained:
            raise InvalidParameter(fmt.param, "constrained output is not supported with --tp; "
                                   'use tool_choice "auto" and no response_format')
        info = self._require()
        settings = (settings or GenerationSettings()).resolved(
            info["generation_config"], context_tokens=info["context_tokens"])
        if settings.seed is None and not is_greedy(settings):
            # Every rank samples for itself: one seed for all of them keeps them in step.
            settings = replace(settings, seed=random.getrandbits(63))
        prompt, settings = prepare_reply(info["tokenizer"], messages, settings,
                                         context_tokens=info["context_tokens"],
                                         system_prompt=system_prompt, thinking=thinking,
                                         tools=fmt.rendered_tools)
        if self.log_prompts:
            log.info("prompt: %r", prompt.text)
        stats = ReplyStats()
        tokens = self._tokens(prompt.input_ids, settings, self._eos_ids(info), stop, stats)
        try:
            yield from reply_updates(tokens, info["tokenizer"], prompt, stats)
        except Exception:
            if self.group is not None and not self.group.alive():
                self.unload()  # the group is gone: say so in status, start afresh on load
            raise
        finally:
            stop.set()
            tokens.close()

    def _tokens(self, input_ids, settings, eos_ids, stop, stats) -> Iterator[int]:
        result = yield from self.group.generate(input_ids, settings, eos_ids, stop)
        for name, value in result.items():
            setattr(stats, name, value)
        stats.decode_path = f"tensor-parallel eager ({self.tp} workers)"

    def generate_text(self, messages, settings=None, **kwargs) -> ChatUpdate:
        final = None
        for final in self.chat(messages, settings, **kwargs):
            pass
        return final
