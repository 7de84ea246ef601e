"""The one object that owns the loaded model: load, unload, switch, under one lock.

A switch is transactional: the old model is unloaded first (two 7B models rarely fit at once),
and if the new one fails to load for any reason the old one is loaded again, same mode and same
placement, before the error reaches the caller. Unload checks that memory came back.

Everything that can be judged without the weights is judged before the old model is unloaded
(preflight): the request's types, the folder and every file in it, safetensors present and
their headers readable, the config, the mode on this hardware, the devices and caps, the
context window, and the fit, with the memory the old model would free counted as free. A
refusal then costs nothing; only a failure of the load itself costs a reload (minutes for a
14B model).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

from model_utils.errors import NO_MODEL, LoadError, ModelBusy
from model_utils.layers.weight_only import load_quantized
from model_utils.memory import GB

from . import preflight
from .adapter import apply_adapter, check_adapter
from .load_messages import user_message
from .load_stages import Progress, StageClock
from .load_stages import summary as stage_summary
from .loaded_model import LoadedModel, LoadRequest, SwitchCost, UnloadReport
from .memory_accounting import (
    _fmt,
    _release_freed_memory,
    drop_error_frames,
    memory_counters,
    stored_bytes,
    summarize_device_map,
    unload_report,
)
from .modes import get_mode, quantization_config, torch_dtype, unpackable_linears
from .modes import unavailable_reason as mode_unavailable
from .parked_models import ParkedModels
from .placement import FitEstimate, check_placement, device_map_kwargs, may_offload_to_cpu
from .placement import unavailable_reason as placement_unavailable
from .registry import ModelRegistry, ModelSource
from .tokenizer_reuse import KeptTokenizer, tokenizer_key

log = logging.getLogger(__name__)


def text_only_note(config, model) -> str:
    """A checkpoint with a vision tower (Qwen3.5's, say) loads as its language model: say so."""
    if getattr(config, "vision_config", None) is None:
        return ""
    if any("visual" in name for name, _ in model.named_children()) or \
            hasattr(getattr(model, "model", None), "visual"):
        return ""
    return ("its vision tower is not loaded: this app chats in text, so the checkpoint's "
            "language model alone is")


class ModelManager:
    def __init__(self, registry: ModelRegistry, *, trust_remote_code: bool = False,
                 busy_timeout_s: float = 30.0, park_gb: float = 0.0):
        self.registry = registry
        # Models a switch replaced, kept in host memory for a switch back (--park-gb).
        self.parked = ParkedModels(park_gb)
        self.trust_remote_code = trust_remote_code
        self.busy_timeout_s = busy_timeout_s
        self._lock = threading.RLock()  # one load/unload/switch at a time
        self._users = 0  # replies streaming from the current model
        self._switching = False  # while a load/unload waits for replies, new ones wait (no starving)
        self._users_changed = threading.Condition()
        self._loaded: LoadedModel | None = None
        self.last_unload: UnloadReport | None = None
        # Called with each freshly loaded model; the engine attaches its fast path here.
        self.on_loaded: Callable[[LoadedModel, Progress], None] | None = None
        self.on_unloaded: Callable[[], None] | None = None
        # Per device, the memory the loaded model's serving holds beside its weights (the
        # engine's batch KV cache): a switch gives it back too.
        self.held_beside: Callable[[], dict[str, float]] = dict

    # -- using the model ---------------------------------------------------------------------
    @property
    def loaded(self) -> LoadedModel | None:
        return self._loaded

    @contextlib.contextmanager
    def use(self) -> Iterator[LoadedModel]:
        """Hold the current model for one reply; a switch waits until every holder is done."""
        with self._users_changed:
            if not self._users_changed.wait_for(lambda: not self._switching,
                                                timeout=self.busy_timeout_s):
                raise ModelBusy("a model switch is in progress: try again in a moment")
            loaded = self._loaded
            if loaded is None:
                raise LoadError(NO_MODEL)
            self._users += 1
        try:
            yield loaded
        finally:
            with self._users_changed:
                self._users -= 1
                self._users_changed.notify_all()

    @contextlib.contextmanager
    def _switch(self) -> Iterator[None]:
        """Hold new replies back, wait for running ones to end, then let the caller switch."""
        with self._users_changed:
            self._switching = True
            try:
                if not self._users_changed.wait_for(lambda: self._users == 0,
                                                    timeout=self.busy_timeout_s):
                    raise ModelBusy(f"{self._users} reply(s) still streaming after "
                                    f"{self.busy_timeout_s:.0f} s: try the switch again when "
                                    "they end")
            except BaseException:
                self._switching = False
                self._users_changed.notify_all()
                raise
        try:
            yield
        finally:
            with self._users_changed:
                self._switching = False
                self._users_changed.notify_all()

    # -- load / unload / switch --------------------------------------------------------------
    def load(self, request: LoadRequest, progress: Progress | None = None) -> LoadedModel:
        """Load `request`, replacing the current model; on failure the previous one is back."""
        progress = progress or (lambda _f, _m: None)
        requested = time.perf_counter()  # the switch's cost counts the checks and waits too
        with self._lock:
            # Plainly wrong input (no such folder, unknown mode) is refused before the current
            # model is touched; only a failure of the load itself costs a reload.
            try:
                self._preflight(request)
            except Exception as error:
                raise LoadError(user_message(error)) from error
            with self._switch():
                return self._replace_locked(request, progress, requested)

    def _replace_locked(self, request: LoadRequest, progress: Progress,
                        requested: float) -> LoadedModel:
        previous = self._loaded.request if self._loaded else None
        kept, replaced, unload_s = None, "", 0.0
        if previous is not None:
            last = self._loaded.ready_s
            replaced = f"{self._loaded.display_name} ({self._loaded.mode.name})"
            if self._loaded.tokenizer_key is not None:
                kept = KeptTokenizer(self._loaded.tokenizer_key, self._loaded.tokenizer)
            progress(0.05, f"unloading {replaced} (its load took {last:.0f} s)")
            start = time.perf_counter()
            self._unload_locked(park=True)
            # Rounded once, as the status keeps it, so the two never say different tenths.
            unload_s = round(time.perf_counter() - start, 3)
            progress(0.08, f"unloaded {replaced} in {unload_s:.1f} s")

        def cost(failed: str = "") -> SwitchCost:
            return SwitchCost(time.perf_counter() - requested, replaced, unload_s,
                              self._loaded.tokenizer_kept, failed, self._loaded.weights_parked)

        try:
            loaded = self._load_locked(request, progress, kept)
            loaded.switch = cost()
            return loaded
        except Exception as error:
            reason = user_message(error)
            log.error("load of %s (%s, %s) failed: %s", request.model, request.mode,
                      request.placement.describe(), reason,
                      exc_info=not isinstance(error, LoadError))
            drop_error_frames(error)  # else the failed model stays alive through the restore
            _release_freed_memory()
            if previous is None:
                raise LoadError(reason) from error
            progress(0.9, "load failed: restoring the previous model")
            try:
                # Only its name kept here: this frame stays in the raised error's traceback,
                # and a local holding the model (or its tokenizer, `kept`) would outlive the
                # next unload for as long as a caller holds the error.
                restored = self._load_locked(previous, progress, kept).display_name
                kept = None
                # Named by its last part: the status is every page's, guests' too, and
                # neither a server path nor the reason (which may hold one) belongs there.
                self._loaded.switch = cost(f"{Path(request.model).name} in {request.mode}")
            except Exception as restore_error:
                log.exception("could not restore the previous model")
                drop_error_frames(restore_error)
                kept = None  # nothing is loaded: the tokenizer goes too
                raise LoadError(f"{reason}; restoring the previous model failed too: "
                                f"{user_message(restore_error)}") from error
            raise LoadError(f"{reason}. The previous model ({restored}, "
                            f"{previous.mode}, {previous.placement.describe()}) "
                            "is serving again.") from error

    def unload(self) -> UnloadReport | None:
        with self._lock, self._switch():
            # An unload asked for is memory asked back. The parked models go before the
            # unload's collection: one in reference cycles, dropped after it, stayed.
            self.parked.clear()
            report = self._unload_locked()  # the serving stops first: no GPU work left on it
            if report is None:  # nothing was loaded, so nothing collected
                _release_freed_memory()
            return report

    def estimate(self, request: LoadRequest) -> FitEstimate:
        try:
            _source, mode, config = self._check(request)
        except Exception as error:
            raise LoadError(user_message(error)) from error
        # What a load would find: the current model's memory is freed before it.
        return preflight.fit(config, mode, request, preflight.held_gb(self._loaded, self.held_beside()))[0]

    def _preflight(self, request: LoadRequest) -> None:
        """Refuse, while the current model still serves, whatever would fail the load for a
        reason known without the weights; the fit counts the current model's memory as free."""
        source, mode, config = self._check(request)
        estimate, _, _ = preflight.fit(config, mode, request, preflight.held_gb(self._loaded, self.held_beside()))
        if not estimate.fits:
            raise LoadError(f"{source.label} in {mode.name} does not fit: {estimate.message()}")

    def _config(self, source: ModelSource):
        return preflight.read_config(source, trust_remote_code=self.trust_remote_code)

    @staticmethod
    def _context_tokens(config, request: LoadRequest) -> int:
        return preflight.context_tokens(config, request.context_tokens)

    def _check(self, request: LoadRequest, progress: Progress | None = None):
        """Resolve and validate a request without loading anything (but the demo model's
        build on its first use, which `progress` hears)."""
        preflight.check_types(request)
        source = self.registry.resolve(request.model, progress)
        preflight.require_safetensors(source)
        mode = get_mode(request.mode)
        preflight.check_compute_dtype(mode, request.compute_dtype)
        if source.adapter is not None and mode.is_weight_only:
            # The layers are quantized as they load; peft has no adapter for the app's own
            # weight-only layers, and merging first would mean a second copy of the weights.
            raise LoadError(f"{source.label}: an adapter loads in fp32, bf16, fp16 and the "
                            f"bitsandbytes modes, not in {mode.name}")
        if source.adapter is not None:
            check_adapter(source.adapter)  # a crafted folder: refused before the unload
        check_placement(request.placement)
        target = request.placement.target
        device_kind = "cpu" if target == "cpu" else "cuda"
        if reason := placement_unavailable(target) or mode_unavailable(mode, device=device_kind):
            raise LoadError(reason)
        if request.placement.offload_folder:
            # The load writes weights there: only under folders the operator allowed.
            self.registry.check_under_roots(request.placement.offload_folder, "offload folder")
        config = self._config(source)
        preflight.check_context(config, request.context_tokens)
        return source, mode, config

    def _load_locked(self, request: LoadRequest, progress: Progress,
                     kept: KeptTokenizer | None = None) -> LoadedModel:
        """Load `request` (nothing is loaded now); `kept`: the tokenizer of the model a
        switch replaced, taken again when this load would read the same one."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        progress = clock = StageClock(progress)
        progress(0.1, f"resolving {request.model}")
        source, mode, config = self._check(request, progress)
        before = memory_counters()
        start = time.perf_counter()
        if (parked := self.parked.take(request, progress)) is not None:
            loaded = replace(parked, memory_before_load=before, weights_parked=True,
                             load_s=time.perf_counter() - start, tokenizer_kept=False)
            return self._ready_locked(loaded, clock)
        estimate, context, context_note = preflight.fit(config, mode, request)
        if not estimate.fits:
            raise LoadError(f"{source.label} in {mode.name} does not fit: {estimate.message()}")
        kwargs = device_map_kwargs(request.placement, estimate)
        on_cpu = request.placement.target == "cpu" or may_offload_to_cpu(kwargs)
        skip = unpackable_linears(config) if mode.uses_bitsandbytes and \
            mode.quantization != "int8" and on_cpu else None
        quant = quantization_config(mode, compute_dtype=request.compute_dtype,
                                    cpu_offload=may_offload_to_cpu(kwargs), skip=skip)
        kwargs["dtype"] = mode.dtype
        if quant is not None:
            kwargs["quantization_config"] = quant
        logged_kwargs = {k: (v.to_dict() if hasattr(v, "to_dict") else str(v))
                         for k, v in kwargs.items()}
        # An adapter folder carries the tokenizer it was trained with (chat template included).
        tokenizer_folder = source.adapter or source.path
        key = tokenizer_key(tokenizer_folder, trust_remote_code=self.trust_remote_code)
        tokenizer = kept.for_key(key) if kept is not None else None
        if tokenizer is not None:
            progress(0.2, f"keeping the tokenizer of {source.label}: its files are unchanged")
        else:
            progress(0.2, f"loading tokenizer of {source.label}")
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder,
                                                      trust_remote_code=self.trust_remote_code)
        progress(0.3, f"loading weights in {mode.name} ({estimate.plan})")
        if mode.is_weight_only:  # quantized by the app as it loads, one layer at a time
            kwargs["dtype"] = torch_dtype(request.compute_dtype)
            model = load_quantized(source.path, mode.weight_only_bits, mode.group_size,
                                   progress=progress, fmt=mode.weight_format, use_safetensors=True,
                                   trust_remote_code=self.trust_remote_code, **kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                source.path, use_safetensors=True, trust_remote_code=self.trust_remote_code,
                **kwargs)
        if source.adapter is not None:
            progress(0.5, f"applying the adapter {source.adapter.name}")
            model = apply_adapter(model, source.adapter, merge=not mode.uses_bitsandbytes)
        model.eval()
        load_s = time.perf_counter() - start
        loaded = LoadedModel(
            source=source, request=request, mode=mode, model=model, tokenizer=tokenizer,
            context_tokens=context, context_note=context_note,
            notes=[n for n in (context_note, text_only_note(config, model)) if n], load_s=load_s,
            footprint_gb=sum(stored_bytes(t) for t in [*model.parameters(),
                                                       *model.buffers()]) / GB,
            device_map=summarize_device_map(model), estimate=estimate,
            from_pretrained_kwargs=logged_kwargs, memory_before_load=before, tokenizer_key=key,
            tokenizer_kept=kept is not None and tokenizer is kept.tokenizer,
        )
        return self._ready_locked(loaded, clock)

    def _ready_locked(self, loaded: LoadedModel, clock: StageClock) -> LoadedModel:
        """Make `loaded` the current model and let the engine prepare it."""
        progress, source, mode = clock, loaded.source, loaded.mode
        self._loaded = loaded
        if self.on_loaded is not None:
            try:
                self.on_loaded(loaded, progress)
            except BaseException:
                # A model its preparation failed on (a capture out of memory, say) is not
                # loaded: left as the current one it would stay alive through the restore,
                # beside the model restored, and a first load would look ready when not.
                self._loaded = None
                if self.on_unloaded is not None:
                    self.on_unloaded()  # what the preparation built goes with it
                raise
        loaded.stages, loaded.ready_s = clock.finish(), clock.elapsed
        self.parked.reserve_for(loaded)  # its parking buffer, made while it serves
        after = memory_counters()
        log.info("loaded %s mode=%s placement=%s in %.2f s; from_pretrained(%s, %s); "
                 "footprint %.3f GB; device map %s; memory before %s after %s",
                 source.label, mode.name, loaded.request.placement.describe(), loaded.load_s,
                 source.path, loaded.from_pretrained_kwargs, loaded.footprint_gb,
                 loaded.device_map, _fmt(loaded.memory_before_load), _fmt(after))
        clock.report(1.0, f"loaded {source.label} in {mode.name}: ready in {loaded.ready_s:.1f} s "
                          f"({stage_summary(loaded.stages)})")
        return loaded

    def _unload_locked(self, park: bool = False) -> UnloadReport | None:
        """Unload the current model; `park`: keep it in host memory where parking allows."""
        if self._loaded is None:
            return None
        name = f"{self._loaded.display_name} ({self._loaded.mode.name})"
        baseline = self._loaded.memory_before_load
        before = memory_counters()
        model = weakref.ref(self._loaded.model)
        unloaded, self._loaded = self._loaded, None
        if self.on_unloaded is not None:
            start = time.perf_counter()
            self.on_unloaded()  # the engine's serving goes first, parked or not
            log.info("serving of %s stopped in %.2f s", name, time.perf_counter() - start)
        parked_gb = 0.0
        if park and self.parked.limit_gb > 0:
            if reason := self.parked.park(unloaded):
                log.info("not parking %s: %s", name, reason)
            else:
                parked_gb, model = unloaded.footprint_gb, None  # alive on purpose
        # with the engine's serving dropped above, the last reference
        del unloaded
        report = unload_report(name, baseline, before, model, parked_gb=parked_gb)
        self.last_unload = report
        return report

    # -- status -------------------------------------------------------------------------------
    def status(self) -> dict:
        loaded = self._loaded
        status = loaded.status() if loaded is not None else {"loaded": False}
        if self.parked.limit_gb > 0:
            status["parked"] = {"models": self.parked.names(), "gb": round(self.parked.gb, 3),
                                "limit_gb": self.parked.limit_gb}
        return status

