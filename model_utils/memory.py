"""Memory snapshots: per GPU (NVML used/total, torch allocated/reserved) and CPU RAM/process RSS.

NVML sees what the driver has handed out to every process (what nvidia-smi shows); torch sees
what this process's caching allocator holds. Both matter: "reserved" that NVML still counts after
an unload is memory the cache kept, and empty_cache gives it back.

torch is not imported here: a process that never imported it (the app in front of a remote
model server) holds no CUDA memory of its own, and its GPUs are listed from NVML alone.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field

import psutil

GB = 1024**3
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuMemory:
    index: int
    name: str
    used_gb: float | None  # NVML: every process on the device
    total_gb: float
    allocated_gb: float  # torch: tensors of this process
    reserved_gb: float  # torch: allocator cache of this process


@dataclass(frozen=True)
class MemorySnapshot:
    time: float
    gpus: list[GpuMemory]
    cpu_used_gb: float
    cpu_total_gb: float
    process_rss_gb: float
    note: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


class _Nvml:
    """NVML, initialised once for the process (nvmlInit costs milliseconds and a driver
    round trip; the sampler reads it every couple of seconds) and never shut down: the
    handles stay valid for as long as the process runs."""

    def __init__(self):
        self._lock = threading.Lock()
        self._handles: list | None = None  # None: not tried yet; []: unavailable

    def _init_locked(self) -> list:
        try:
            import pynvml

            pynvml.nvmlInit()
            return [pynvml.nvmlDeviceGetHandleByIndex(i)
                    for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:  # noqa: BLE001 - no package or no driver: NVML raises its own types
            return []

    def usage(self) -> dict[int, tuple[float, float]]:
        """index -> (used GB, total GB); empty when NVML is unavailable."""
        with self._lock:
            if self._handles is None:
                self._handles = self._init_locked()
            handles = self._handles
        if not handles:
            return {}
        import pynvml

        usage = {}
        for i, handle in enumerate(handles):
            try:
                info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception:  # a device fell off the bus: skip its figures
                log.warning("NVML could not read device %d", i, exc_info=True)
                continue
            usage[i] = (info.used / GB, info.total / GB)
        return usage


_NVML = _Nvml()


def _nvml_usage() -> dict[int, tuple[float, float]]:
    return _NVML.usage()


def torch_cuda_gb() -> dict[str, float]:
    """This process's CUDA memory over every device: tensors (allocated), what the allocator
    holds including CUDA-graph pools (reserved), and the allocated peak since the last reset.
    Empty without CUDA."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return {}
    devices = range(torch.cuda.device_count())
    return {"allocated_gb": round(sum(torch.cuda.memory_allocated(i) for i in devices) / GB, 3),
            "reserved_gb": round(sum(torch.cuda.memory_reserved(i) for i in devices) / GB, 3),
            "peak_allocated_gb": round(sum(torch.cuda.max_memory_allocated(i)
                                           for i in devices) / GB, 3)}


def take_snapshot() -> MemorySnapshot:
    gpus = []
    note = ""
    torch = sys.modules.get("torch")  # see the module docstring
    if torch is None:
        gpus = [GpuMemory(index=i, name=f"GPU {i}", used_gb=used, total_gb=total,
                          allocated_gb=0.0, reserved_gb=0.0)
                for i, (used, total) in sorted(_nvml_usage().items())]
        if not gpus:
            note = "no CUDA GPU on this machine: only CPU memory is shown"
    elif torch.cuda.is_available():
        # NVML numbers devices physically; with CUDA_VISIBLE_DEVICES set they may not match
        # torch's order, so NVML figures are only attached when the two counts agree.
        nvml = _nvml_usage()
        if len(nvml) != torch.cuda.device_count():
            nvml = {}
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            used, total = nvml.get(i, (None, props.total_memory / GB))
            gpus.append(GpuMemory(
                index=i,
                name=props.name,
                used_gb=used,
                total_gb=total,
                allocated_gb=torch.cuda.memory_allocated(i) / GB,
                reserved_gb=torch.cuda.memory_reserved(i) / GB,
            ))
    else:
        note = "no CUDA GPU on this machine: only CPU memory is shown"
    vm = psutil.virtual_memory()
    return MemorySnapshot(
        time=time.time(),
        gpus=gpus,
        cpu_used_gb=(vm.total - vm.available) / GB,
        cpu_total_gb=vm.total / GB,
        process_rss_gb=psutil.Process().memory_info().rss / GB,
        note=note,
    )


@dataclass
class MemoryHistory:
    """A bounded history of snapshots for the plots (oldest dropped first).

    One sampler thread (start_sampling) records a point every few seconds for the whole
    process, so the history covers the same minutes however many pages are open, and the
    pages only read it.
    """

    max_points: int = 300
    _points: deque = field(default_factory=deque)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _sampler: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def record(self) -> MemorySnapshot:
        snap = take_snapshot()
        with self._lock:
            self._points.append(snap)
            while len(self._points) > self.max_points:
                self._points.popleft()
        return snap

    def points(self) -> list[MemorySnapshot]:
        with self._lock:
            return list(self._points)

    # -- the background sampler -----------------------------------------------------------
    def start_sampling(self, interval_s: float = 2.0) -> None:
        """Record a point now and then every `interval_s` on a daemon thread; a second
        call while it runs does nothing."""
        with self._lock:
            if self.sampling:
                return
            self._stop.clear()
            self._sampler = threading.Thread(target=self._sample, args=(interval_s,),
                                             name="memory-sampler", daemon=True)
            self._sampler.start()

    def stop_sampling(self) -> None:
        self._stop.set()
        sampler = self._sampler
        if sampler is not None:
            sampler.join(timeout=10)

    @property
    def sampling(self) -> bool:
        return self._sampler is not None and self._sampler.is_alive()

    def latest(self) -> MemorySnapshot:
        """The newest sampled point while the sampler runs (reading it costs nothing);
        without a sampler, a fresh snapshot that is not added to the history."""
        with self._lock:
            newest = self._points[-1] if self._points else None
        return newest if newest is not None and self.sampling else take_snapshot()

    def _sample(self, interval_s: float) -> None:
        while not self._stop.is_set():
            try:
                self.record()
            except Exception:  # a failed reading must not end the sampler
                log.exception("memory sample failed")
            self._stop.wait(interval_s)
