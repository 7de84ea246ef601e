"""Models a switch put aside in host memory, so that switching back does not read and
quantize them again (`--park-gb`, off by default).

A switch unloads the model it replaces; with parking on, that model's weights move to host
memory instead of being freed (from a GPU into one page-locked buffer per model, so that they go
back at the copy engine's speed and the buffer's memory returns to the system when the model is
dropped: HostCopy), and a later load of the very same request (model, mode, placement,
compute dtype and context, with none of the folder's files changed since) takes them back
instead of reading the checkpoint. The engine then prepares the model as after any load (its
compiled code is kept per kind of model: model_utils.runtime.compiled_code), so what a switch
back saves is the reading, the quantizing and gemlite's checks.

Parked are only models whose every weight is on one device, as a plain tensor or as a
bitsandbytes 4-bit parameter (whose quantization state's tensors move with it): not LLM.int8
(`int8`: its layers keep state of their own), not a model spread over devices or offloaded to
disk. The buffer of a model taken back stays,
as a spare for the next model parked. The parked models and spare buffers stay under the limit
and leave MIN_FREE_HOST_GB of host memory free; spares go first, then the least recently
parked. An explicit unload frees them all: whoever unloads wants the memory back.

Locking a fresh buffer takes seconds (its pages are faulted in and pinned), longer than the copy
into it; so once a GPU model is loaded, a spare buffer of its size is made on a thread of its own
(reserve_for) while the model serves, within the limit, and the switch away from it copies into
that buffer instead of waiting for a new one."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import torch

from model_utils.memory import GB

from .host_copy import HostCopy, is_4bit, model_weights, move_weights

if TYPE_CHECKING:
    from .loaded_model import LoadedModel, LoadRequest

log = logging.getLogger(__name__)

MIN_FREE_HOST_GB = 4.0  # what parking leaves to the rest of the machine
SPARE_SLACK = 1.5  # a spare buffer takes a model of at least 1/SPARE_SLACK of its size


@dataclass(frozen=True)
class FolderKey:
    """What a parked model was read from: (name, size, mtime_ns) of every file of the model's
    folder and of its adapter's, so that a checkpoint replaced in place loads afresh."""

    files: tuple[tuple[str, str, int, int], ...]


def folder_key(*folders: Path | None) -> FolderKey:
    files = []
    for folder in filter(None, folders):
        for path in sorted(Path(folder).rglob("*")):
            if path.is_file():
                stat = path.stat()
                files.append((str(folder), str(path.relative_to(folder)), stat.st_size,
                              stat.st_mtime_ns))
    return FolderKey(tuple(files))


@dataclass
class Parked:
    loaded: LoadedModel
    device: torch.device
    key: FolderKey
    gb: float
    host: HostCopy | None = None  # a GPU model's weights while parked


def unparkable_reason(loaded: LoadedModel) -> str:
    """Why this model cannot be parked ("" when it can)."""
    if loaded.mode.quantization == "int8":
        return "LLM.int8's layers keep quantization state of their own"
    tensors = [*loaded.model.parameters(), *loaded.model.buffers()]
    devices = {t.device for t in tensors}
    if len(devices) != 1 or next(iter(devices)).type == "meta":
        return "the model is spread over devices or offloaded"
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) and not is_4bit(t)
           for t in tensors):
        return "some weights are neither plain tensors nor bitsandbytes 4-bit ones"
    return ""


class ParkedModels:
    def __init__(self, limit_gb: float = 0.0):
        self.limit_gb = limit_gb
        # By repr(request): a request is frozen but holds a dict (the placement's caps).
        self._parked: OrderedDict[str, Parked] = OrderedDict()
        # The page-locked buffers of models taken back, kept (within the limit) for the next
        # model a switch parks: switching between two modes then parks each into the buffer
        # it left, and only the first switches pay for fresh buffers.
        self._spares: list[HostCopy] = []
        self._reserving: threading.Thread | None = None  # a spare being made (reserve_for)

    def _snapshot(self) -> tuple[Parked, ...]:
        # One C-level copy: a status poll reads this while a switch may change the dict.
        return tuple(self._parked.values())

    @property
    def gb(self) -> float:
        """Host memory parking holds: the parked models and the spare buffers."""
        return sum(p.gb for p in self._snapshot()) + sum(s.gb for s in tuple(self._spares))

    def names(self) -> list[str]:
        return [f"{p.loaded.display_name} ({p.loaded.mode.name})" for p in self._snapshot()]

    def reserve_for(self, loaded: LoadedModel) -> None:
        """Start making a spare buffer for the weights of `loaded` (just loaded, on a GPU), so
        that parking it later copies at once: only when none fits already and it fits the
        limit and the free host memory as they are (a spare made ahead of need drops nothing).
        The buffer is made on a thread of its own; park and clear wait for it. Never raises:
        the load it follows is done, and without a spare a park makes its own buffer."""
        try:
            if self.limit_gb <= 0 or unparkable_reason(loaded):
                return
            if next(loaded.model.parameters()).device.type != "cuda":
                return  # a CPU model parks as it is: no buffer
            self.wait()
            self._reserving = self.reserve(HostCopy.needed_bytes(model_weights(loaded.model)))
        except Exception:  # noqa: BLE001 - see above
            log.warning("no parking buffer made ahead for %s", loaded.display_name,
                        exc_info=True)

    def reserve(self, nbytes: int) -> threading.Thread | None:
        """A thread making a spare buffer of `nbytes` (started), or None when one of the spares
        fits already or there is no room for it."""
        gb = nbytes / GB
        room = self.limit_gb - self.gb
        if (any(nbytes <= s.buffer.numel() <= SPARE_SLACK * nbytes for s in self._spares)
                or gb > room or _free_host_gb() < MIN_FREE_HOST_GB + gb):
            return None

        def make() -> None:
            start = time.perf_counter()
            try:
                spare = HostCopy.blank(nbytes)
            except Exception as error:  # noqa: BLE001 - no spare: a park makes its own buffer
                log.warning("no spare host buffer of %.2f GB made ahead: %s", gb, error)
                return
            self._spares.append(spare)
            log.info("a spare host buffer of %.2f GB made ahead for parking in %.2f s%s", gb,
                     time.perf_counter() - start, "" if spare.pinned else " (not page-locked)")

        thread = threading.Thread(target=make, name="park-buffer", daemon=True)
        thread.start()
        return thread

    def wait(self) -> None:
        """Until a spare being made is made."""
        if (thread := self._reserving) is not None:
            thread.join()
            if self._reserving is thread:  # not one a load started meanwhile (a bench's wait)
                self._reserving = None

    def park(self, loaded: LoadedModel) -> str:
        """Keep `loaded` (already detached from serving) with its weights in host memory:
        "" when parked, else why not (it is then freed as usual)."""
        if self.limit_gb <= 0:
            return "parking is off (--park-gb 0)"
        self.wait()  # the spare made for it, if one is being made
        if reason := unparkable_reason(loaded):
            return reason
        gb = loaded.footprint_gb
        if gb > self.limit_gb:
            return f"its {gb:.1f} GB exceed --park-gb {self.limit_gb:g}"
        if (older := self._parked.pop(repr(loaded.request), None)) is not None:
            _release(older)  # an older copy of the same request
        device = next(loaded.model.parameters()).device
        weights = model_weights(loaded.model) if device.type == "cuda" else []
        spare = self._take_spare(HostCopy.needed_bytes(weights)) if weights else None
        while self.gb + (spare.gb if spare else gb) > self.limit_gb and self._make_room():
            pass
        # A GPU model's weights are about to take host memory (none more where a spare buffer
        # takes them); a CPU model's already do, and the next load needs room of its own
        # beside them (about as much, as a guess).
        wanted = MIN_FREE_HOST_GB + (0.0 if spare else gb)
        while _free_host_gb() < wanted and self._make_room():
            pass
        if _free_host_gb() < wanted:
            if spare is not None:
                spare.release()
            return f"host memory too short to keep its {gb:.1f} GB"
        key = folder_key(loaded.source.path, loaded.source.adapter)  # before any buffer
        host = None
        if device.type == "cuda":
            start = time.perf_counter()
            try:
                host = HostCopy(weights, spare)
                move_weights(loaded.model, host.copy)
                torch.cuda.synchronize(device)
            except Exception as error:  # noqa: BLE001 - not parked: the model is freed as usual
                for buffer in (host, spare):
                    if buffer is not None:
                        buffer.release()
                return f"copying it to host memory failed ({type(error).__name__}: {error})"
            log.info("parked %s (%s) in host memory%s%s: %.2f GB in %.2f s",
                     loaded.display_name, loaded.mode.name,
                     "" if host.pinned else " (not page-locked)",
                     " (a spare buffer)" if spare else "", gb, time.perf_counter() - start)
        # What it holds of host memory: a spare buffer may be somewhat larger than its weights.
        held = max(gb, host.gb) if host is not None else gb
        self._parked[repr(loaded.request)] = Parked(loaded, device, key, held, host)
        return ""

    def take(self, request: LoadRequest, progress=None) -> LoadedModel | None:
        """The parked model of `request`, its weights back on their device; None when none is
        parked or its files changed since."""
        parked = self._parked.pop(repr(request), None)
        if parked is None:
            return None
        loaded = parked.loaded
        if folder_key(loaded.source.path, loaded.source.adapter) != parked.key:
            log.info("not taking the parked %s back: its files changed", loaded.display_name)
            _release(parked)
            return None
        if progress is not None:
            where = f" to {parked.device}" if parked.device.type == "cuda" else ""
            progress(0.3, f"taking the parked {loaded.display_name} in {loaded.mode.name} "
                          f"back{where} ({parked.gb:.1f} GB)")
        if parked.device.type == "cuda":
            move_weights(loaded.model, lambda t: t.to(parked.device, non_blocking=True))
            torch.cuda.synchronize(parked.device)
        if parked.host is not None:
            self._spares.append(parked.host)  # no view into it is left: the weights moved
            parked.host = None
        _release(parked)
        return replace(loaded, stages=[], ready_s=0.0, switch=None)

    def clear(self) -> None:
        self.wait()
        while self._parked:
            _release(self._parked.popitem()[1])
        while self._spares:
            self._spares.pop().release()

    def _take_spare(self, needed_bytes: int) -> HostCopy | None:
        """The smallest spare buffer that holds `needed_bytes` and is not much larger (the
        rest would sit idle), out of the spares."""
        fitting = [s for s in self._spares
                   if needed_bytes <= s.buffer.numel() <= SPARE_SLACK * needed_bytes]
        if not fitting:
            return None
        spare = min(fitting, key=lambda s: s.buffer.numel())
        self._spares.remove(spare)
        return spare

    def _make_room(self) -> bool:
        """Give back a spare buffer, else the least recently parked model; False when there
        is nothing left to give."""
        if self._spares:
            self._spares.pop(0).release()
        elif self._parked:
            _, parked = self._parked.popitem(last=False)
            _release(parked)
            log.info("dropped the parked %s (%s) to make room", parked.loaded.display_name,
                     parked.loaded.mode.name)
        else:
            return False
        return True


def _free_host_gb() -> float:
    return psutil.virtual_memory().available / GB


def _release(parked: Parked) -> None:
    if parked.host is not None:
        parked.host.release()
        parked.host = None
