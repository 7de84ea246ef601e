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

Parked are only models whose every weight is a plain tensor on one device: not the
bitsandbytes modes (their 4-bit and 8-bit parameters carry quantization state of their own),
not a model spread over devices or offloaded to disk. The buffer of a model taken back stays,
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

if TYPE_CHECKING:
    from .loaded_model import LoadedModel, LoadRequest

log = logging.getLogger(__name__)

MIN_FREE_HOST_GB = 4.0  # what parking leaves to the rest of the machine
SPARE_SLACK = 1.5  # a spare buffer takes a model of at least 1/SPARE_SLACK of its size
CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


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


class HostCopy:
    """Every weight of a GPU model in one host buffer, page-locked by registering it with CUDA.

    Not torch's pinned tensors: its pinned-memory cache rounds each block up to a power of two
    (up to twice a weight's size) and keeps freed blocks for the life of the process, so the
    host memory of parked models stayed taken after they were dropped (BENCHMARKS.md,
    "Switching modes"). A registered buffer holds what the weights need and goes back to the
    system with the last view into it."""

    ALIGN = 256  # bytes: each weight starts at a multiple of this from the buffer's start

    def __init__(self, tensors: list[torch.Tensor], spare: HostCopy | None = None):
        """`spare`: the buffer of a copy whose weights went back to the GPU, reused (it must
        hold needed_bytes(tensors)): a fresh buffer's pages are faulted in and locked one by
        one, which takes longer than the copy itself."""
        # Offsets in the order the tensors are given: copy() is handed them in that order.
        self._places: list[tuple[int, int]] = []
        total = 0
        for tensor in tensors:
            size = _span(tensor) * tensor.element_size()
            self._places.append((total, size))
            total += -(-size // self.ALIGN) * self.ALIGN
        self._places.reverse()
        if spare is not None:
            if spare.buffer.numel() < total:
                raise ValueError("the spare buffer is smaller than the weights")
            self.buffer, self.pinned = spare.buffer, spare.pinned
            spare.buffer, spare.pinned = None, False  # handed over, not released
        else:
            self.buffer = torch.empty(total, dtype=torch.uint8)
            self.pinned = _register(self.buffer)

    @classmethod
    def blank(cls, nbytes: int) -> HostCopy:
        """A page-locked buffer of `nbytes` holding nothing yet: a spare made ahead of need."""
        copy = cls([])
        copy.buffer = torch.empty(nbytes, dtype=torch.uint8)
        copy.pinned = _register(copy.buffer)
        return copy

    @classmethod
    def needed_bytes(cls, tensors: list[torch.Tensor]) -> int:
        return sum(-(-_span(t) * t.element_size() // cls.ALIGN) * cls.ALIGN for t in tensors)

    @property
    def gb(self) -> float:
        buffer = self.buffer  # read once: a switch may release it while a status poll reads
        return buffer.numel() / GB if buffer is not None else 0.0

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """The next tensor's place in the buffer (same dtype, shape and strides), its copy
        under way."""
        start, size = self._places.pop()
        if size != _span(tensor) * tensor.element_size():
            raise RuntimeError("a weight changed size between sizing and copying")
        host = self.buffer[start:start + size].view(tensor.dtype).as_strided(
            tensor.shape, tensor.stride())
        return host.copy_(tensor, non_blocking=self.pinned)

    def release(self) -> None:
        """Unregister the buffer: after the weights left it, or before a dropped model's views
        into it go (the memory itself goes with the last of them)."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self.pinned = False
        self.buffer = None


def unparkable_reason(loaded: LoadedModel) -> str:
    """Why this model cannot be parked ("" when it can)."""
    if loaded.mode.uses_bitsandbytes:
        return f"{loaded.mode.name} weights carry bitsandbytes' quantization state"
    tensors = [*loaded.model.parameters(), *loaded.model.buffers()]
    devices = {t.device for t in tensors}
    if len(devices) != 1 or next(iter(devices)).type == "meta":
        return "the model is spread over devices or offloaded"
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors):
        return "some weights are not plain tensors"
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
            self._reserving = self.reserve(HostCopy.needed_bytes(_weights(loaded.model)))
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
        weights = _weights(loaded.model) if device.type == "cuda" else []
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
                _move(loaded.model, host.copy)
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
            _move(loaded.model, lambda t: t.to(parked.device, non_blocking=True))
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


def _register(buffer: torch.Tensor) -> bool:
    """Page-lock `buffer` in place; False (it stays pageable, the copies synchronous) where
    CUDA refuses, e.g. a locked-memory limit.

    The pages are faulted in first, by torch's threads writing them all at once: cudaHostRegister
    would fault them in one by one on a single thread, the slower part of locking a fresh buffer
    (torch's own host allocator does the same with `pinned_use_cuda_host_register`)."""
    if not torch.cuda.is_available() or buffer.numel() == 0:
        return False
    start = time.perf_counter()
    buffer.zero_()  # a parallel fill: every page faulted in, on all of torch's threads
    faulted = time.perf_counter()
    # Portable: page-locked for every device's context, not only the current one's.
    error = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(),
                                                     CUDA_HOST_REGISTER_PORTABLE))
    if error:
        log.warning("parked weights are not page-locked (cudaHostRegister error %d)", error)
    else:
        log.info("a host buffer of %.2f GB: pages faulted in %.2f s (%d threads), locked in "
                 "%.2f s", buffer.numel() / GB, faulted - start, torch.get_num_threads(),
                 time.perf_counter() - faulted)
    return error == 0


def _span(tensor: torch.Tensor) -> int:
    """Elements from a tensor's first to its last, whatever its strides (non-negative)."""
    if tensor.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """What _move will hand its function, in the same order."""
    return [p.data for p in model.parameters()] + [
        b for m in model.modules() for b in m._buffers.values() if b is not None]


def _move(model: torch.nn.Module, to) -> None:
    """Every parameter and buffer of `model` to to(tensor), in place: the modules keep their
    Parameter objects (tied weights stay tied) and their buffers' names."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.data = to(parameter.data)
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = to(buffer)
